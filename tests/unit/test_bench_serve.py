"""``kvserve bench serve`` without a server: its prompts, its figures, and its streaming
client against scripted responses (httpx's MockTransport)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from kvserve.benchmarks.online.serve_client import (
    RequestRecord,
    RunRecord,
    Target,
    make_client,
    run_requests,
    stream_request,
)
from kvserve.benchmarks.online.serve_metrics import median_of, summarize
from kvserve.benchmarks.workloads.prompts import Prompt, approx_words, make_prompts
from kvserve.benchmarks.workloads.text import random_words

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
TARGET = Target("http://127.0.0.1:9/v1", "m", "completions", max_tokens=4)
PROMPT = Prompt(None, "Hello there")


def prompts(kind: str = "distinct", seed: int = 0, round_name: str = "run-0") -> list[Prompt]:
    return make_prompts(kind, 32, 40, 200, seed, round_name)


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others() -> None:
    for kind in ("distinct", "shared-prefix"):
        assert prompts(kind, seed=3) == prompts(kind, seed=3)
        assert prompts(kind, seed=3) != prompts(kind, seed=4)
    assert random_words(random.Random(5), 30) == random_words(random.Random(5), 30)


def test_each_round_draws_its_own_prompts() -> None:
    # A repetition must not find the previous one's prompts in the server's prefix cache.
    assert prompts(round_name="run-0") != prompts(round_name="run-1")
    assert prompts(round_name="run-0") != prompts(round_name="warmup")


def test_distinct_prompts_differ_from_their_first_words() -> None:
    batch = prompts("distinct")
    assert all(prompt.system is None for prompt in batch)
    openings = {" ".join(prompt.user.split()[:4]) for prompt in batch}
    assert len(openings) == len(batch)


def test_several_prefixes_each_serve_some_requests() -> None:
    batch = make_prompts("shared-prefix", 32, 40, 200, 0, "run-0", num_prefixes=3)
    systems = [prompt.system for prompt in batch]
    assert len(set(systems)) == 3
    assert all(
        system is not None and len(system.split()) == approx_words(200) for system in systems
    )
    assert len({prompt.user for prompt in batch}) == len(batch)


def test_shared_prefix_prompts_share_one_system_prompt_and_ask_their_own_questions() -> None:
    batch = prompts("shared-prefix")
    system = batch[0].system
    assert system is not None and len(system.split()) == approx_words(200)
    assert all(prompt.system == system for prompt in batch)
    assert len({prompt.user for prompt in batch}) == len(batch)
    # For /completions the shared text is the prompt's beginning.
    assert all(prompt.text.startswith(system + "\n\n") for prompt in batch)


def test_prompt_lengths_follow_the_token_estimate() -> None:
    assert approx_words(116) == 100
    assert approx_words(1) == 1
    assert all(len(prompt.user.split()) == approx_words(40) for prompt in prompts())
    with pytest.raises(ValueError, match="num_words"):
        random_words(random.Random(0), 0)


def test_request_bodies_stream_with_usage_and_ignore_eos() -> None:
    prompt = Prompt("You are terse.", "Why?")
    chat = Target("http://h/v1/", "m", "chat", 7).body(prompt)
    assert chat["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Why?"},
    ]
    completion = Target("http://h/v1", "m", "completions", 7).body(prompt)
    assert completion["prompt"] == "You are terse.\n\nWhy?"
    for body in (chat, completion):
        assert body["max_tokens"] == 7 and body["model"] == "m"
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
    assert Target("http://h/v1/", "m", "chat").url == "http://h/v1/chat/completions"
    assert Target("http://h/v1/", "m", api_key="k").headers == {"Authorization": "Bearer k"}


# ---------------------------------------------------------------- the client


def event(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def text_event(text: str) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


DONE = b"data: [DONE]\n\n"


def streaming(parts: list[bytes], pause_s: float = 0.0) -> Handler:
    """A handler answering 200 with ``parts`` sent one by one, ``pause_s`` apart."""

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            await asyncio.sleep(pause_s)
            yield part

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    return handle


def send(handler: Handler, timeout_s: float = 5.0) -> RequestRecord:
    async def go() -> RequestRecord:
        async with make_client(4, timeout_s, httpx.MockTransport(handler)) as client:
            return await stream_request(client, TARGET, PROMPT, timeout_s)

    return asyncio.run(go())


def test_tokens_come_from_usage_when_chunks_carry_several() -> None:
    chat_role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    chat_text = event({"choices": [{"index": 0, "delta": {"content": "ab"}}]})
    usage = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    parts = [chat_role, chat_text, text_event("cde"), usage, DONE]
    record = send(streaming(parts, pause_s=0.05))
    assert record.error is None
    assert record.num_tokens == 5
    # The role-only event carries no text: two chunks, one gap between them.
    assert len(record.chunk_times) == 2 and len(record.gaps) == 1
    assert record.gaps[0] >= 0.04
    assert record.itl == pytest.approx(record.gaps[0] / 4)
    assert record.ttft is not None and record.ttft >= 0.09


def test_without_usage_each_text_chunk_counts_as_one_token() -> None:
    record = send(streaming([text_event("a"), text_event(""), text_event("bc"), DONE]))
    assert record.error is None
    assert record.usage_tokens is None and record.num_tokens == 2


def test_a_running_usage_total_counts_its_last_value() -> None:
    parts = [
        event({"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}),
        event({"choices": [{"text": "b"}], "usage": {"completion_tokens": 2}}),
        DONE,
    ]
    assert send(streaming(parts)).num_tokens == 2


def test_lines_break_only_at_sse_line_ends() -> None:
    # U+2028 and U+0085 stay raw inside JSON strings; CRLF may be split between reads.
    first = 'data: {"choices": [{"text": "a\u2028b\u0085c"}]}\r'.encode()
    parts = [first, b"\n\r\n", b'data: {"choices": [{"text": "d"}]}\r\n\r\n', DONE]
    record = send(streaming(parts))
    assert record.error is None
    assert len(record.chunk_times) == 2


def test_an_error_status_is_a_failed_request_with_the_servers_message() -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        body = {"error": {"message": "Invalid API key.", "code": "invalid_api_key"}}
        return httpx.Response(401, json=body)

    assert send(refuse).error == "HTTP 401: Invalid API key."

    async def html(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>" + "x" * 1000 + "</html>")

    error = send(html).error
    assert error is not None and error.startswith("HTTP 502: <html>xx") and len(error) < 320


def test_an_error_event_inside_the_stream_fails_the_request() -> None:
    failure = event({"error": {"message": "generation failed", "code": 500}})
    record = send(streaming([text_event("a"), failure, DONE]))
    assert record.error == "error event: generation failed"


def test_a_stream_cut_before_done_or_not_json_fails_the_request() -> None:
    assert send(streaming([text_event("a")])).error == "the stream ended before data: [DONE]"
    error = send(streaming([b"data: {oops\n\n", DONE])).error
    assert error is not None and error.startswith("an event that is not JSON")


def test_a_refused_connection_is_a_failed_request() -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    assert send(refuse).error == "ConnectError: Connection refused"


def never_answer() -> Handler:
    async def handle(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        raise AssertionError("the client should have given up")

    return handle


def test_a_slow_request_times_out() -> None:
    start = time.monotonic()
    assert send(never_answer(), timeout_s=0.2).error == "timed out after 0.2 s"
    assert time.monotonic() - start < 5


def run(handler: Handler, num: int, concurrency: int, max_duration_s: float = 30) -> RunRecord:
    async def go() -> RunRecord:
        async with make_client(concurrency, 30, httpx.MockTransport(handler)) as client:
            batch = [PROMPT] * num
            return await run_requests(client, TARGET, batch, concurrency, 30, max_duration_s)

    return asyncio.run(go())


def test_a_run_stops_at_its_cap_and_counts_what_was_left_as_failed() -> None:
    start = time.monotonic()
    result = run(never_answer(), num=5, concurrency=2, max_duration_s=0.3)
    assert time.monotonic() - start < 5
    assert 0.3 <= result.wall_s < 5
    assert len(result.requests) == 5
    assert all("0.3 s cap" in (record.error or "") for record in result.requests)


def test_concurrency_is_never_exceeded() -> None:
    in_flight = peak = 0
    full = asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == 3:
            full.set()
        # The first requests stay until 3 run at once (a second at most, if fewer ever do),
        # so reaching the peak does not depend on how fast the others were sent.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(full.wait(), 1)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return httpx.Response(200, content=text_event("a") + DONE)

    result = run(handle, num=10, concurrency=3)
    assert peak == 3
    assert [record.error for record in result.requests] == [None] * 10


# ---------------------------------------------------------------- the figures


def test_summary_figures_from_known_times() -> None:
    records = [
        RequestRecord(start=0.0, chunk_times=[1.0, 1.5, 2.0], usage_tokens=5),
        RequestRecord(start=1.0, chunk_times=[3.0, 3.1]),
        RequestRecord(start=0.0, chunk_times=[0.5], error="HTTP 500: boom"),
    ]
    metrics = summarize(RunRecord(4.0, records))
    assert (metrics.num_succeeded, metrics.num_failed) == (2, 1)
    assert metrics.output_tokens == 7 and metrics.num_counted_by_usage == 1
    assert metrics.output_tokens_per_s == pytest.approx(7 / 4)
    assert metrics.requests_per_s == pytest.approx(2 / 4)
    # TTFTs 1.0 and 2.0 s; ITLs 1.0 / 4 and 0.1 / 1 s; gaps 0.5, 0.5, 0.1 s.
    assert metrics.ttft_p50_ms == pytest.approx(1500)
    assert metrics.ttft_p99_ms == pytest.approx(1990)
    assert metrics.itl_p50_ms == pytest.approx(175)
    assert metrics.gap_p50_ms == pytest.approx(500)
    assert metrics.gap_max_ms == pytest.approx(500)


def test_medians_over_repetitions_keep_counts_whole() -> None:
    runs = [
        summarize(RunRecord(wall, [RequestRecord(0.0, [1.0, 2.0], tokens)]))
        for wall, tokens in ((2.0, 4), (4.0, 5), (3.0, 6), (5.0, 7))
    ]
    median = median_of(runs)
    assert median.wall_s == 3.5
    assert median.output_tokens == 5  # a count some run really had
    assert median.num_succeeded == 1
