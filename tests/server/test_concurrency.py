"""64 streamed requests at once: all complete with the right lengths, batched together.

And one client's prompt being tokenized holds up no other client's stream.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from kvserve.entrypoints.openai import serving_chat

NUM_CLIENTS = 64


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    return start_tiny_server(max_waiting_requests=NUM_CLIENTS)


async def one_stream(client: openai.AsyncOpenAI, index: int) -> tuple[int, int, str, str]:
    """(tokens asked for, tokens reported in usage, streamed text, finish_reason)."""
    max_tokens = 8 + index % 9
    stream = await client.completions.create(
        model="tiny",
        prompt=f"Request number {index} says",
        max_tokens=max_tokens,
        temperature=0.7,
        seed=index,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish_reason, completion_tokens = "", "", -1
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish_reason = choice.finish_reason or finish_reason
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return max_tokens, completion_tokens, text, finish_reason


def hold_steps_until_all_arrived(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's first step waits (30 s at most) until every client's request is in.

    Else a fast engine could finish the first requests before the last ones arrive,
    and no step would run most of them together, however right the batching.
    """
    arrived = 0
    prepare = server.async_engine.prepare
    step = server.async_engine.engine.step

    def counting_prepare(*args: Any, **kwargs: Any) -> Any:
        nonlocal arrived
        arrived += 1
        return prepare(*args, **kwargs)

    def held_step() -> Any:
        deadline = time.monotonic() + 30
        while arrived < NUM_CLIENTS and time.monotonic() < deadline:
            time.sleep(0.001)
        return step()

    monkeypatch.setattr(server.async_engine, "prepare", counting_prepare)
    monkeypatch.setattr(server.async_engine.engine, "step", held_step)


def test_64_concurrent_streams_complete_and_share_steps(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run() -> list[tuple[int, int, str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
        async with client:
            return await asyncio.gather(*(one_stream(client, i) for i in range(NUM_CLIENTS)))

    hold_steps_until_all_arrived(server, monkeypatch)
    results = asyncio.run(asyncio.wait_for(run(), 120))
    for max_tokens, completion_tokens, text, finish_reason in results:
        assert completion_tokens == max_tokens
        assert finish_reason == "length"
        assert text
    assert server.metric("kvserve_generation_tokens_total") == sum(r[0] for r in results)
    # The batch-size histogram: some step ran more than half of the clients at once.
    steps = server.metric("kvserve_iteration_batch_size_count")
    steps_of_at_most_32 = server.metric("kvserve_iteration_batch_size_bucket", le="32.0")
    assert steps_of_at_most_32 < steps
    server.wait_idle()
    assert server.metric("kvserve_num_requests_running") == 0
    assert server.metric("kvserve_kv_cache_blocks_used") == 0


def test_metrics_endpoint_exposes_the_documented_series(server: Any) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    for name in [
        "kvserve_num_requests_running",
        "kvserve_num_requests_waiting",
        "kvserve_kv_cache_blocks_used",
        "kvserve_kv_cache_blocks_total",
        "kvserve_prompt_tokens_total",
        "kvserve_generation_tokens_total",
        "kvserve_num_preemptions_total",
        "kvserve_iteration_batch_size_bucket",
        "kvserve_time_to_first_token_seconds_bucket",
        "kvserve_inter_token_latency_seconds_bucket",
        "kvserve_e2e_request_latency_seconds_bucket",
        "kvserve_request_queue_time_seconds_bucket",
    ]:
        assert f"\n{name}{{" in text, name
    assert server.metric("kvserve_kv_cache_blocks_total") == 511
    assert server.metric("kvserve_time_to_first_token_seconds_count") == NUM_CLIENTS
    assert server.metric("kvserve_e2e_request_latency_seconds_count") == NUM_CLIENTS


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_being_tokenized_holds_up_no_stream(
    server: Any, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []

    def held(work: Callable[..., Any]) -> Callable[..., Any]:
        # Stands for a huge prompt: tokenizing takes until the test says so.
        def run(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            entered.set()
            assert release.wait(20)
            return work(*args, **kwargs)

        return run

    runner = server.async_engine.engine.runner
    execute = runner.execute

    def slow_execute(scheduler_output: Any) -> Any:
        time.sleep(0.01)  # so the running stream still has tokens to send later
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", slow_execute)
    stream_body = {"prompt": "Once upon", "max_tokens": 40, "ignore_eos": True, "stream": True}
    held_body: dict[str, Any] = {"max_tokens": 2}
    if endpoint == "/v1/completions":
        target, name = server.async_engine, "tokenize"
        held_body["prompt"] = "A huge prompt"
    else:
        target, name = serving_chat, "encode_chat"
        held_body["messages"] = [{"role": "user", "content": "A huge conversation"}]
    responses: list[httpx.Response] = []
    held_request = threading.Thread(
        target=lambda: responses.append(
            httpx.post(server.url + endpoint, json=held_body, timeout=30)
        )
    )
    url = f"{server.url}/v1/completions"
    try:
        with httpx.stream("POST", url, json=stream_body, timeout=5) as running:
            events = (line for line in running.iter_lines() if line.startswith("data: "))
            next(events)
            monkeypatch.setattr(target, name, held(getattr(target, name)))
            held_request.start()
            assert entered.wait(10)
            # Were the tokenizer on the event loop, nothing would move until it let go.
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            assert list(events)[-1] == "data: [DONE]"
            assert held_request.is_alive()
    finally:
        release.set()
        if held_request.is_alive():
            held_request.join(30)
    assert responses[0].status_code == 200, responses[0].text
    assert threads and all(name.startswith("kvserve-tokenize") for name in threads)
