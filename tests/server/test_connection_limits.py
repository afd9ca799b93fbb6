"""Connections: a slow request head or body, an idle keep-alive and too many at once are cut off.

Too many: past ``limit_concurrency`` in all, or past ``limit_concurrency_per_peer``
from one address; /health is answered either way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvserve.entrypoints.openai.connection_limits import ConnectionCounts, peer_key
from waiting import wait_for

HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    return start_tiny_server(timeout_header=0.5, timeout_keep_alive=0.5)


def connect(server: Any) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket) -> None:
    """Reads (and drops) what the server sends until it closes the connection."""
    while sock.recv(4096):
        pass


# The timers run 0.5 s from when the server got the connection (or sent its answer), after
# the clock below was read: however late this thread runs, it cannot see them end sooner.
def test_a_connection_that_never_sends_a_head_is_closed(server: Any) -> None:
    started = time.monotonic()
    with connect(server) as sock:
        read_until_closed(sock)
        assert 0.3 < time.monotonic() - started < 5


def test_a_head_sent_a_line_at_a_time_is_cut_off_at_the_header_timeout(server: Any) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        # Every line would reset an idle timer, keeping the connection for the whole trickle
        # (6 s); the header timer counts from the start and cuts it at 0.5 s. The bound sits
        # far from both, so neither a slow nor a fast machine lands on the wrong side.
        for _ in range(60):
            time.sleep(0.1)
            try:
                sock.sendall(b"X-Slow: y\r\n")
            except OSError:
                break
        read_until_closed(sock)
        assert time.monotonic() - started < 3


def test_a_prompt_head_is_served_and_an_idle_keep_alive_is_closed(server: Any) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(HEALTH_REQUEST)
        response = sock.recv(4096)
        assert response.startswith(b"HTTP/1.1 200 ")
        read_until_closed(sock)
        assert 0.3 < time.monotonic() - started < 5


def test_a_second_request_on_a_kept_alive_connection_gets_its_own_header_timeout(
    server: Any,
) -> None:
    with connect(server) as sock:
        sock.sendall(HEALTH_REQUEST)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # stops uvicorn's keep-alive timer
        started = time.monotonic()
        read_until_closed(sock)
        assert time.monotonic() - started < 5


@pytest.fixture(scope="module")
def crowded_server(start_tiny_server: Any) -> Iterator[Any]:
    yield start_tiny_server(limit_concurrency=3)


def assert_too_many_connections(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "too_many_connections")


def test_past_the_concurrency_limit_new_requests_get_503_and_health_still_answers(
    crowded_server: Any,
) -> None:
    idle = [connect(crowded_server) for _ in range(3)]  # the limit: the next one is past it
    try:
        deadline = time.monotonic() + 5
        while (response := httpx.get(f"{crowded_server.url}/v1/models")).status_code != 503:
            assert time.monotonic() < deadline, "the limit was never reached"
            time.sleep(0.05)
        assert_too_many_connections(response)
        assert httpx.get(f"{crowded_server.url}/health").status_code == 200  # probes get through
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{crowded_server.url}/v1/models").status_code != 200:
        assert time.monotonic() < deadline, "the server did not recover"
        time.sleep(0.05)


# A body must arrive within 0.5 s of its head, plus 1 s per 100 bytes received.
BODY_LIMITS = {"timeout_body": 0.5, "min_body_rate": 100}
PER_PEER = 3


@pytest.fixture(scope="module")
def slow_body_server(start_tiny_server: Any) -> Any:
    # Every test connection comes from 127.0.0.1: the per-peer cap is the total's here.
    return start_tiny_server(limit_concurrency=4, limit_concurrency_per_peer=4, **BODY_LIMITS)


def stalled_body(server: Any, path: str = "/v1/completions") -> socket.socket:
    """A connection that sent a whole head, 10 of its 100 body bytes, then nothing."""
    sock = connect(server)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        "Content-Length: 100\r\n\r\n".encode()
        + b'{"prompt":'
    )
    return sock


def read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):  # after what was sent before the reset
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks)


def test_stalled_bodies_are_cut_off_with_408_and_hold_no_slot(slow_body_server: Any) -> None:
    # As many stalled bodies as the server has slots: before the body timeout they held
    # them for ever, and everyone but them got 503.
    started = time.monotonic()
    stalled = [stalled_body(slow_body_server) for _ in range(4)]
    try:
        for sock in stalled:
            answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert b'"code":"request_timeout"' in answer.replace(b" ", b"")
        assert time.monotonic() - started < 5  # 0.5 s each; far from "for ever"
    finally:
        for sock in stalled:
            sock.close()
    response = httpx.post(
        f"{slow_body_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
    )
    assert response.status_code == 200, response.text


def test_while_stalled_bodies_fill_the_slots_health_answers(slow_body_server: Any) -> None:
    stalled = [stalled_body(slow_body_server) for _ in range(5)]
    try:
        assert httpx.get(f"{slow_body_server.url}/health").status_code == 200
    finally:
        for sock in stalled:
            sock.close()


def test_a_body_trickling_below_the_minimum_rate_is_cut_off(slow_body_server: Any) -> None:
    with stalled_body(slow_body_server) as sock:
        started = time.monotonic()
        # 2 bytes every 0.1 s is 20 bytes/s, a fifth of the minimum rate: each piece buys
        # 0.02 s and resets no timer, so the connection is cut at about 0.6 s, long before
        # the 4 s the trickle would last (and its 90 bytes never complete the body).
        for _ in range(40):
            if select.select([sock], [], [], 0.1)[0]:  # answered: stop, as a client would
                break
            try:
                sock.sendall(b"  ")
            except OSError:
                break
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert time.monotonic() - started < 3


def test_a_slow_body_that_keeps_the_minimum_rate_is_served(slow_body_server: Any) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode().ljust(400)  # JSON may pad
    with connect(slow_body_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        # 1.2 s in all, more than the 0.5 s a body gets, but 100 bytes (1 s more) a tenth
        # of a second apart: far above the minimum rate.
        for start in range(0, len(body), 50):
            time.sleep(0.1)
            sock.sendall(body[start : start + 50])
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")


def test_a_body_cut_off_is_one_408_line_in_the_log(slow_body_server: Any) -> None:
    with captured_logs() as records:
        with stalled_body(slow_body_server) as sock:
            assert read_response(sock).startswith(b"HTTP/1.1 408 ")
        wait_for(lambda: access_lines(records), what="the access log line")
        time.sleep(0.2)  # anything logged after it would be in by now
    lines = access_lines(records)
    assert len(lines) == 1 and " /v1/completions status=408 " in lines[0], lines
    assert not [r for r in records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_client_that_leaves_during_its_body_is_one_499_line_in_the_log(
    server: Any, path: str
) -> None:
    # It was a 500 with two tracebacks of about 125 lines each.
    with captured_logs() as records:
        stalled_body(server, path).close()
        wait_for(lambda: access_lines(records), what="the access log line")
        time.sleep(0.2)
    lines = access_lines(records)
    assert len(lines) == 1 and f" {path} status=499 " in lines[0], lines
    assert not [r for r in records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.fixture(scope="module")
def write_server(start_tiny_server: Any) -> Any:
    server = start_tiny_server(timeout_write=0.5)
    # Connections it accepts inherit a small send buffer (no autotuning up to 4 MiB), so
    # a client that reads nothing fills it, and uvicorn's own, with a few hundred KB.
    server._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    return server


def test_a_client_that_reads_nothing_of_its_response_is_disconnected(write_server: Any) -> None:
    # About 1 MB of events (8 choices, 240 tokens, 20 logprobs each), to a socket with a
    # small receive buffer that is never read: the server's buffer fills, and the client
    # makes no room for 0.5 s. Without the limit, the whole stream waits for the client.
    body = {"prompt": "hi", "max_tokens": 240, "ignore_eos": True, "n": 8, "logprobs": 20}
    content = json.dumps({**body, "stream": True}).encode()
    host, port = write_server.url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(content)}\r\n\r\n".encode()
            + content
        )
        time.sleep(3)  # reads nothing
        received = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" not in received, len(received)  # cut off, not served to the end
    write_server.wait_idle()  # and its request was aborted


@pytest.fixture(scope="module")
def per_peer_server(start_tiny_server: Any) -> Any:
    return start_tiny_server(limit_concurrency_per_peer=PER_PEER)


def test_past_its_per_peer_cap_a_client_gets_503_and_health_still_answers(
    per_peer_server: Any,
) -> None:
    held = [connect(per_peer_server) for _ in range(PER_PEER)]
    try:
        deadline = time.monotonic() + 5
        # The next connection from 127.0.0.1 is its N+1th.
        while (response := httpx.get(f"{per_peer_server.url}/v1/models")).status_code != 503:
            assert time.monotonic() < deadline, "the per-peer cap was never reached"
            time.sleep(0.05)
        assert_too_many_connections(response)
        assert "your address" in response.json()["error"]["message"]
        assert httpx.get(f"{per_peer_server.url}/health").status_code == 200
        # The peer's first connections are still served.
        held[0].sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n")
        assert held[0].recv(4096).startswith(b"HTTP/1.1 200 ")
        held.pop().close()  # one fewer: the peer is back under its cap
        deadline = time.monotonic() + 5
        while httpx.get(f"{per_peer_server.url}/v1/models").status_code != 200:
            assert time.monotonic() < deadline, "the peer's slot was not given back"
            time.sleep(0.05)
    finally:
        for sock in held:
            sock.close()


def test_peers_are_ipv4_addresses_and_ipv6_64_prefixes() -> None:
    assert peer_key(("127.0.0.1", 5000)) == peer_key(("127.0.0.1", 6000)) == "127.0.0.1"
    assert peer_key(("::ffff:10.0.0.1", 1)) == "10.0.0.1"
    assert peer_key(("2001:db8::1", 1)) == peer_key(("2001:db8::ffff:1", 2))
    assert peer_key(("2001:db8:0:1::1", 1)) != peer_key(("2001:db8::1", 1))
    assert peer_key(None) == "unix"


def test_a_peer_s_oldest_connections_are_admitted_and_the_next_takes_a_freed_place() -> None:
    counts = ConnectionCounts(limit_concurrency=10, limit_per_peer=2)
    a, b, c, other = object(), object(), object(), object()
    for connection in (a, b, c):
        counts.connect(connection, "1.2.3.4")
    counts.connect(other, "5.6.7.8")
    assert counts.num_admitted == 3  # c, past its peer's cap, does not count in the total
    assert counts.refusal(a, "1.2.3.4") is None and counts.refusal(other, "5.6.7.8") is None
    refusal = counts.refusal(c, "1.2.3.4")
    assert refusal is not None and refusal.status_code == 503
    counts.disconnect(a, "1.2.3.4")
    assert counts.refusal(c, "1.2.3.4") is None and counts.num_admitted == 3
    for connection in (b, c):
        counts.disconnect(connection, "1.2.3.4")
    counts.disconnect(other, "5.6.7.8")
    assert counts.num_admitted == 0 and not counts.peers


@contextlib.contextmanager
def captured_logs() -> Iterator[list[logging.LogRecord]]:
    """Every record of kvserve's and uvicorn's loggers (uvicorn's do not reach the root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("kvserve", "uvicorn", "uvicorn.error")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def access_lines(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.name == "kvserve.access"]
