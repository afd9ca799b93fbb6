"""Connections: a slow request head, an idle keep-alive and too many at once are cut off."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

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


def test_past_the_concurrency_limit_new_requests_get_503(crowded_server: Any) -> None:
    idle = [connect(crowded_server) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while httpx.get(f"{crowded_server.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "the limit was never reached"
            time.sleep(0.05)
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{crowded_server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the server did not recover"
        time.sleep(0.05)
