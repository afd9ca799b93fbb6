"""Clients that leave, steps that fail, a full queue: the server keeps serving everyone else.

A failure inside the server reaches the client as a generic message and an
error id; the details are in the log, under that id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from waiting import wait_for

PROMPT = "The quick brown fox"
POISON_TOKEN = 13  # a prompt starting with this token makes the model fail
# What the injected failures say: internal detail a client must never see.
FAULT_TEXT = "injected fault in /srv/kvserve/secret_module.py"


def slow_down(server: Any, seconds: float) -> None:
    """Make every step take at least ``seconds``, so requests are long enough to leave."""
    runner = server.async_engine.engine.runner
    execute = runner.execute

    def slow_execute(scheduler_output: Any) -> Any:
        time.sleep(seconds)
        return execute(scheduler_output)

    runner.execute = slow_execute


def long_request(**fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, **fields}


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    server = start_tiny_server()
    slow_down(server, 0.005)
    runner = server.async_engine.engine.runner
    execute = runner.execute

    def poisoned_execute(scheduler_output: Any) -> Any:
        for item in scheduler_output.scheduled:
            if item.request.prompt_token_ids[0] == POISON_TOKEN:
                raise RuntimeError(FAULT_TEXT)
        return execute(scheduler_output)

    runner.execute = poisoned_execute
    return server


async def read_a_few_events_then_leave(url: str, num_events: int) -> int:
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", url, json=long_request(stream=True)) as response,
    ):
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == num_events:
                    return seen  # leaving the block closes the connection mid-stream
    return seen


def test_twenty_clients_leaving_mid_stream_free_every_block(server: Any) -> None:
    aborted_before = abort_count(server)
    generated_before = server.metric("kvserve_generation_tokens_total")

    async def clients() -> list[int]:
        url = f"{server.url}/v1/completions"
        return await asyncio.gather(*(read_a_few_events_then_leave(url, 3) for _ in range(20)))

    assert asyncio.run(clients()) == [3] * 20
    server.wait_idle(timeout=30)
    assert abort_count(server) - aborted_before == 20
    # Counted in steps, not seconds, so a slow machine does not fail it: the aborts came a
    # few steps after the clients left, far before the 200 tokens each asked for.
    generated = server.metric("kvserve_generation_tokens_total") - generated_before
    assert generated < 20 * 200 / 2
    response = httpx.post(f"{server.url}/v1/completions", json=long_request(max_tokens=5))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5


def test_a_client_leaving_a_non_streamed_request_aborts_it(server: Any) -> None:
    aborted_before = abort_count(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=long_request(), timeout=0.3)
    server.wait_idle(timeout=10)  # it would end by itself too: the abort count tells
    assert abort_count(server) - aborted_before == 1


def logged_error(caplog: pytest.LogCaptureFixture, message: str) -> logging.LogRecord:
    """The log record of the error id in ``message``; the message must hold nothing more."""
    assert FAULT_TEXT not in message and "RuntimeError" not in message
    match = re.search(r"\(error id ([0-9a-f]{32})\)\.$", message)
    assert match is not None, message
    records = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    return records[0]


def test_a_failing_step_fails_that_request_and_the_server_goes_on(
    server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{server.url}/v1/completions"
    with caplog.at_level(logging.ERROR, logger="kvserve"):
        response = httpx.post(url, json=long_request(prompt=[POISON_TOKEN, 5, 6]))
        stream = httpx.stream("POST", url, json=long_request(prompt=[POISON_TOKEN, 7], stream=True))
        with stream as r:
            assert r.status_code == 200  # the failure came after the headers
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "generation_failed")
    record = logged_error(caplog, error["message"])
    assert record.exc_info is not None and FAULT_TEXT in str(record.exc_info[1])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error"
    record = logged_error(caplog, error["message"])
    assert record.exc_info is not None and FAULT_TEXT in str(record.exc_info[1])
    server.wait_idle()
    assert httpx.get(f"{server.url}/health").status_code == 200
    response = httpx.post(url, json=long_request(max_tokens=4))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_access_log_has_one_line_per_request(server: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.access"):
        response = httpx.post(f"{server.url}/v1/completions", json=long_request(max_tokens=6))
        httpx.post(f"{server.url}/v1/completions", json=long_request(temperature=-1))
    request_id = response.json()["id"]
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.access"]
    assert len(lines) == 2
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert lines[0].startswith(f"{request_id} /v1/completions status=200")
    assert f"prompt_tokens={prompt_tokens} generated_tokens=6 ttft=" in lines[0]
    assert lines[0].endswith("finish=length")
    fields = dict(part.split("=", 1) for part in lines[0].split() if "=" in part)
    # Timed as tokens arrive, even though the response is sent whole at the end.
    assert float(fields["ttft"].rstrip("s")) < float(fields["total"].rstrip("s"))
    assert "status=400" in lines[1]


def test_a_dead_engine_answers_503_with_an_error_id_and_logs_why(
    start_tiny_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_tiny_server()
    engine = server.async_engine

    def broken_report(stats: Any) -> None:
        raise RuntimeError(FAULT_TEXT)

    engine._report = broken_report  # a bug in the loop itself, after the first step
    url = f"{server.url}/v1/completions"
    with caplog.at_level(logging.ERROR, logger="kvserve"):
        during = httpx.post(url, json=long_request(max_tokens=4))
    after = httpx.post(url, json=long_request(max_tokens=4))
    for response in (during, after):
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable"
        record = logged_error(caplog, error["message"])
        assert record.exc_info is not None and FAULT_TEXT in str(record.exc_info[1])
    # Both name the one failure that killed the loop.
    assert during.json()["error"]["message"] == after.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 503


def test_an_unexpected_error_in_a_handler_is_logged_under_the_id_it_answers_with(
    server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_tokenize(prompt: Any) -> Any:
        raise RuntimeError(FAULT_TEXT)

    monkeypatch.setattr(server.async_engine, "tokenize", broken_tokenize)
    with caplog.at_level(logging.ERROR, logger="kvserve"):
        response = httpx.post(f"{server.url}/v1/completions", json=long_request(max_tokens=2))
    assert response.status_code == 500
    record = logged_error(caplog, response.json()["error"]["message"])
    assert record.exc_info is not None and FAULT_TEXT in str(record.exc_info[1])


@pytest.fixture
def one_seat_server(start_tiny_server: Any) -> Iterator[Any]:
    server = start_tiny_server(engine_args={"max_num_seqs": 1}, max_waiting_requests=1)
    # A 200-token request holds the one seat for at least 10 s: time enough, even on a
    # loaded machine, for a second request to be queued behind it before it finishes.
    slow_down(server, 0.05)
    yield server


def test_a_full_queue_answers_503_with_retry_after(one_seat_server: Any) -> None:
    url = f"{one_seat_server.url}/v1/completions"
    scheduler = one_seat_server.async_engine.engine.scheduler
    with httpx.stream("POST", url, json=long_request(stream=True)) as running:
        assert running.status_code == 200
        # Until its first step has ended, the running request still counts as waiting.
        events = running.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(events).startswith("data: ")
        wait_for(lambda: one_seat_server.metric("kvserve_num_requests_running") >= 1)
        waiting = threading.Thread(
            target=httpx.post,
            args=(url,),
            kwargs={"json": long_request(max_tokens=4), "timeout": 30},
        )
        waiting.start()
        wait_for(lambda: scheduler.num_waiting >= 1)
        refused = httpx.post(url, json=long_request())
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    waiting.join(30)
    assert not waiting.is_alive(), "the queued request got no answer"
    one_seat_server.wait_idle()
    assert httpx.post(url, json=long_request(max_tokens=2)).status_code == 200


def abort_count(server: Any) -> float:
    try:
        return server.metric("kvserve_request_success_total", finish_reason="abort")
    except AssertionError:
        return 0.0
