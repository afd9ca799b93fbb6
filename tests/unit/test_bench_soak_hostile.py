"""The hostile kinds of ``kvserve bench soak`` without a kvserve server: what each sends,
and how each answer (or silence) is counted."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvserve.benchmarks.online.soak_args import add_arguments, check_args, selected_kinds
from kvserve.benchmarks.online.soak_hostile import (
    CLOSED,
    GRAMMAR,
    HOSTILE_KINDS,
    KEPT_OPEN,
    RUNTIME_FAILING_GRAMMARS,
    SLOW_BODY,
    send_hostile,
    slow_body,
)
from kvserve.benchmarks.online.soak_report import KINDS_BY_NAME, HealthProbes, SoakReport
from kvserve.benchmarks.online.soak_requests import KINDS, SoakTarget
from kvserve.benchmarks.online.soak_template import REFUSED_AT_LOAD, TEMPLATE
from kvserve.errors import InvalidParameterError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--base-url", "http://127.0.0.1:9/v1", *argv])


def slow_body_against(handler: Handler, trickle: bool, duration_s: float = 0.5) -> tuple[str, int]:
    """The slow body's outcome against a loopback server running ``handler``, and the bytes
    of body the server received."""
    received = bytearray()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"Content-Length: 4096\r\n" in head
        received.extend(await asyncio.wait_for(reader.read(100), 1.0))
        await handler(reader, writer)

    async def go() -> str:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = SoakTarget(f"http://127.0.0.1:{port}/v1", "m", None, 4, 16, 2, 5, 4096)
        async with server:
            outcome = await slow_body(target, trickle=trickle, duration_s=duration_s)
        return outcome.outcome

    return asyncio.run(go()), len(received)


async def answer_408(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    writer.close()


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def wait_for_ever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(5)


def test_a_slow_body_reports_the_status_the_hang_up_or_the_connection_kept_open() -> None:
    outcome, received = slow_body_against(answer_408, trickle=False)
    assert outcome == "408" and received < 4096
    assert slow_body_against(hang_up, trickle=True)[0] == CLOSED
    assert slow_body_against(wait_for_ever, trickle=False, duration_s=0.3)[0] == KEPT_OPEN
    kind = KINDS_BY_NAME[SLOW_BODY]
    assert all(kind.expects(o) for o in ("408", "400", CLOSED, KEPT_OPEN))
    assert not kind.expects("500")


def grammar_outcomes(reply: Callable[[dict[str, object]], httpx.Response]) -> list[str]:
    bodies: list[dict[str, object]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return reply(bodies[-1])

    async def go() -> list[str]:
        rng = random.Random(0)
        target = SoakTarget("http://127.0.0.1:9/v1", "m", None, 4, 16, 2, 5, 4096)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            kind = KINDS_BY_NAME[GRAMMAR]
            return [(await send_hostile(kind, client, target, rng, 1.0)).outcome for _ in range(8)]

    outcomes = asyncio.run(go())
    assert {body["structured_outputs"]["regex"] for body in bodies} == set(  # type: ignore[index]
        RUNTIME_FAILING_GRAMMARS
    )
    assert {bool(body.get("stream")) for body in bodies} == {True, False}
    return outcomes


def test_runtime_failing_grammars_pass_with_a_4xx_and_fail_with_a_5xx_or_an_error_event() -> None:
    refused = grammar_outcomes(lambda body: httpx.Response(400, json={"error": {}}))
    assert refused == ["400"] * 8
    assert all(KINDS_BY_NAME[GRAMMAR].expects(outcome) for outcome in refused)

    def fail_inside_the_stream(body: dict[str, object]) -> httpx.Response:
        if not body.get("stream"):
            return httpx.Response(500, json={"error": {}})
        text = 'data: {"error": {"message": "grammar"}}\n\n'
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    failed = grammar_outcomes(fail_inside_the_stream)
    assert set(failed) == {"500", "error event"}
    report = SoakReport(1.0, blocks_used_end=0.0, sequences_held_end=0.0)
    for outcome in refused + failed:
        report.record(GRAMMAR, outcome, None)
    assert report.by_kind(GRAMMAR) == {"sent": 16, "2xx": 0, "4xx": 8, "5xx": 8, "unexpected": 8}
    assert report.valid_5xx == 0  # hostile requests: their 5xx fail the run as unexpected
    assert not report.passed
    assert "grammar" in report.format()


def test_the_hostile_kinds_are_opt_in_and_the_template_kind_needs_a_model() -> None:
    assert selected_kinds(args()) == list(KINDS)
    assert selected_kinds(args("--hostile")) == [*KINDS, *HOSTILE_KINDS]
    with_template = selected_kinds(args("--template-model", "tiny"))
    assert [kind.name for kind in with_template][-1] == TEMPLATE
    assert [k.name for k in selected_kinds(args("--kinds", "preempt"))] == ["preempt"]
    with pytest.raises(InvalidParameterError) as error:
        check_args(args("--kinds", "template"))
    assert error.value.param == "kinds"


def test_a_template_refused_at_load_passes_and_a_slow_health_fails_the_run() -> None:
    report = SoakReport(1.0, blocks_used_end=0.0, sequences_held_end=0.0)
    report.record(TEMPLATE, REFUSED_AT_LOAD, "ValueError: the template ...")
    assert report.passed, report.problems()
    report.health = HealthProbes(limit_s=1.0)
    report.health.record(0.01, healthy=True)
    report.health.record(1.5, healthy=True)
    report.health.record(0.2, healthy=False)
    assert report.problems() == ["/health was slower than 1 s 1 times and failed 1 times"]
    assert "slowest 1.500 s" in report.format()
