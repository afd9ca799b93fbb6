"""``kvserve bench soak`` without a server: its verdict, its memory figures, and how each
request's answer (scripted with httpx's MockTransport) becomes an outcome."""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import httpx
import pytest

from kvserve.benchmarks.online.soak import add_arguments, check_args
from kvserve.benchmarks.online.soak_report import MIB, RssSample, SoakReport, summarize_rss
from kvserve.benchmarks.online.soak_requests import KINDS, KINDS_BY_NAME, SoakTarget, send
from kvserve.errors import InvalidParameterError

TARGET = SoakTarget("http://127.0.0.1:9/v1", "m", None, 4, 16, 2, 5, 4096)


def clean_report() -> SoakReport:
    report = SoakReport(duration_s=60.0, blocks_used_end=0.0, sequences_held_end=0.0)
    for kind in KINDS:
        for outcome in sorted(kind.expected):
            report.record(kind.name, outcome, None)
    return report


def test_expected_answers_and_an_empty_server_pass() -> None:
    report = clean_report()
    assert report.passed, report.problems()
    assert report.valid_5xx == 0 and report.num_unexpected == 0
    assert report.format().endswith("PASS")
    assert report.as_json()["passed"] is True


def test_a_5xx_or_an_error_event_on_a_valid_request_fails_the_run() -> None:
    for outcome in ("500", "503", "error event"):
        report = clean_report()
        report.record("stream", outcome, "detail")
        assert report.valid_5xx == 1 and report.num_unexpected == 1
        assert not report.passed and "stream: " + outcome + ": detail" in report.failures


def test_an_unexpected_answer_to_a_hostile_request_fails_but_is_no_valid_5xx() -> None:
    report = clean_report()
    report.record("oversized", "400", None)  # the limit was not applied
    report.record("malformed", "500", None)
    assert report.valid_5xx == 0 and report.num_unexpected == 2
    assert "2 requests got an answer their kind did not expect" in report.problems()


def test_blocks_or_sequences_left_after_the_load_fail_the_run() -> None:
    report = clean_report()
    report.blocks_used_end = 3.0
    assert report.problems() == ["3 KV blocks still in use after the load"]
    report.blocks_used_end, report.sequences_held_end = 0.0, 1.0
    assert report.problems() == ["1 sequences still held after the load"]
    report.blocks_used_end, report.sequences_held_end = None, 0.0
    assert report.problems() == ["the KV blocks in use could not be read from /metrics"]


def test_rss_is_measured_from_the_first_sample_after_warm_up() -> None:
    samples = [RssSample(t, rss * MIB) for t, rss in [(0, 100), (5, 300), (10, 320), (15, 310)]]
    rss = summarize_rss(samples, warmup_s=5)
    assert rss is not None
    assert (rss.warm_bytes, rss.end_bytes, rss.max_bytes) == (300 * MIB, 310 * MIB, 320 * MIB)
    assert (rss.growth_bytes, rss.max_growth_bytes, rss.num_samples) == (10 * MIB, 20 * MIB, 3)
    assert summarize_rss(samples, warmup_s=20) is None


def test_memory_growth_past_the_bound_fails_the_run() -> None:
    report = clean_report()
    report.max_rss_growth_bytes = 10 * MIB
    report.rss = summarize_rss([RssSample(0, 100 * MIB), RssSample(9, 111 * MIB)], 0)
    assert report.problems() == ["resident memory grew 11 MiB after warm-up (allowed 10 MiB)"]
    assert "max drift +11 MiB" in report.format()


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--base-url", "http://127.0.0.1:9/v1", *argv])


def test_defaults_are_twenty_minutes_and_bad_values_are_refused() -> None:
    assert args().duration == 1200.0
    check_args(args())
    for argv, param in [
        (["--warmup", "60", "--duration", "60"], "warmup"),
        (["--concurrency", "0"], "concurrency"),
        (["--server-pid", str(2**22 + 5)], "server_pid"),
    ]:
        with pytest.raises(InvalidParameterError) as error:
            check_args(args(*argv))
        assert error.value.param == param


def outcome_of(kind: str, reply: httpx.Response | Exception, seed: int = 0) -> str:
    async def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def go() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            outcome = await send(KINDS_BY_NAME[kind], client, TARGET, random.Random(seed))
            return outcome.outcome

    return asyncio.run(go())


def preempt_bodies(num_requests: int) -> list[dict[str, object]]:
    """The bodies of preempting requests, each answered with n choices, streamed or not."""
    bodies = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        choices = [{"index": i, "text": "a"} for i in range(body["n"])]
        if body["stream"]:
            return sse({"choices": choices}, "[DONE]")
        return httpx.Response(200, json={"choices": choices})

    async def go() -> list[str]:
        rng = random.Random(0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            kind = KINDS_BY_NAME["preempt"]
            return [(await send(kind, client, TARGET, rng)).outcome for _ in range(num_requests)]

    assert asyncio.run(go()) == ["200"] * num_requests
    return bodies


def sse(*events: object) -> httpx.Response:
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def test_streams_end_in_done_and_a_failure_inside_is_an_error_event() -> None:
    chunk = {"choices": [{"index": 0, "text": "a"}]}
    assert outcome_of("stream", sse(chunk, "[DONE]")) == "200"
    assert outcome_of("stream", sse(chunk)) == "incomplete stream"
    assert outcome_of("stream", sse(chunk, {"error": {"message": "x"}}, "[DONE]")) == "error event"
    assert outcome_of("stream", httpx.Response(503, json={})) == "503"
    assert outcome_of("disconnect", sse(*[chunk] * 10, "[DONE]")) == "disconnected"


def test_answers_become_outcomes() -> None:
    assert outcome_of("json", httpx.Response(200, json={"choices": [{}]})) == "200"
    assert outcome_of("json", httpx.Response(200, json={"choices": []})) == "bad body"
    assert outcome_of("oversized", httpx.Response(413, json={})) == "413"
    assert outcome_of("malformed", httpx.Response(400, json={})) == "400"
    assert outcome_of("json", httpx.ConnectError("refused")) == "transport error"
    assert outcome_of("json", httpx.ReadTimeout("slow")) == "timeout"


def test_preempting_requests_ask_for_n_long_sequences_streamed_or_not() -> None:
    bodies = preempt_bodies(8)
    assert {body["stream"] for body in bodies} == {True, False}
    for body in bodies:
        assert body["n"] == TARGET.preempt_n and body["max_tokens"] == TARGET.long_max_tokens
        assert body["ignore_eos"] is True and body["temperature"] > 0
