"""The live dashboard's state stream, its auth, the load button, and clients coming and going."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from kvserve.engine import LLMEngine
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.entrypoints.openai.uvicorn_server import StreamClosingServer
from waiting import wait_for

API_KEY = "dashboard-key"


def slow_down(server: Any, seconds: float) -> None:
    """Make every engine step take ``seconds`` longer, so short requests last long enough to watch."""
    engine = server.async_engine.engine
    step = type(engine).step

    def slow_step() -> Any:
        time.sleep(seconds)
        return step(engine)

    engine.step = slow_step


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    server = start_tiny_server()
    slow_down(server, 0.01)
    return server


def frames(url: str, headers: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """The frames of ``GET url`` (Server-Sent Events), as they come.

    The read timeout is shorter than the hub's 15-second heartbeat, so a stream
    that stops sending frames fails the test instead of waiting for ever.
    """
    with httpx.stream("GET", url, headers=headers, timeout=5) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[len("data: ") :])


def test_the_stream_shows_a_running_request_holding_its_blocks_then_all_free(server: Any) -> None:
    block_size = server.async_engine.engine.kv_cache_manager.block_size
    result: dict[str, Any] = {}

    def send() -> None:
        # 160 steps of at least 10 ms: over a second and a half of decoding, so even a loaded
        # machine, where slow frames space the next ones out, sends several while it runs.
        body = {"model": "tiny", "prompt": "Paged attention stores keys", "max_tokens": 160}
        response = httpx.post(
            f"{server.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60
        )
        result.update(response.json())

    sender = threading.Thread(target=send)
    seen_running = []
    deadline = time.monotonic() + 90  # the request's own timeout, and room to spare
    for frame in frames(f"{server.url}/dashboard/events"):
        if sender.ident is None:  # the stream is open: now send the request
            sender.start()
        assert time.monotonic() < deadline, "no frame showed the request gone"
        running = [r for r in frame["requests"] if r["phase"] == "decoding"]
        seen_running += running
        # The frame after the request left. (Not "after the response came": the
        # engine's idle frame may come before the client has read the answer.)
        if (seen_running or result) and not frame["requests"]:
            break
    sender.join(30)
    assert result, "the request got no answer"
    assert seen_running, "no frame caught the request while it decoded"
    prompt_tokens = result["usage"]["prompt_tokens"]
    for request in seen_running:
        held = sum(request["blocks"][1::2])
        assert request["prompt_tokens"] == prompt_tokens
        assert held == math.ceil(request["computed_tokens"] / block_size)
    # The last frame: nothing runs, nothing is held, and the steps were counted.
    assert frame["blocks_used"] == 0 and frame["num_running"] == 0
    assert sum(step["decode"] for step in frame["steps"]) > 0


def test_the_page_and_its_files_are_served(server: Any) -> None:
    page = httpx.get(f"{server.url}/dashboard")
    assert page.status_code == 200 and '<canvas id="grid"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    script = httpx.get(f"{server.url}/dashboard/static/main.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith(
        "text/javascript"
    )
    assert httpx.get(f"{server.url}/dashboard/static/..%2Fhub.py").status_code == 404
    assert httpx.get(f"{server.url}/dashboard/info").json() == {"mode": "live", "model": "tiny"}


def test_closed_and_unread_clients_never_hold_the_engine_back_and_closed_ones_leave(
    server: Any,
) -> None:
    hub = server.app.state.dashboard.hub
    server.wait_idle()
    # Twenty clients that read, and five that connect and never read a byte.
    streams = [httpx.stream("GET", f"{server.url}/dashboard/events", timeout=30) for _ in range(20)]
    responses = [stream.__enter__() for stream in streams]
    silent = []
    for _ in range(5):
        sock = socket.create_connection(server.url.removeprefix("http://").split(":"))
        sock.sendall(b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\n\r\n")
        silent.append(sock)
    wait_for(lambda: hub.num_clients == 25)
    # Requests run to their end beside them (the engine is slowed: 10 ms a step).
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True}
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 50
    assert time.monotonic() - started < 20  # 0.5 s of steps; far from it if blocked
    for stream, response_ in zip(streams, responses, strict=True):
        response_.close()
        stream.__exit__(None, None, None)
    for sock in silent:
        sock.close()
    wait_for(lambda: hub.num_clients == 0)


def test_the_load_button_runs_one_bounded_load_at_a_time(server: Any) -> None:
    server.wait_idle()
    url = f"{server.url}/dashboard/load"
    assert httpx.post(url, content=b"{}").status_code == 415  # no JSON content type
    started = httpx.post(url, json={})
    assert started.status_code == 202 and started.json()["load"]["running"]
    total = started.json()["load"]["total"]
    again = httpx.post(url, json={})
    assert again.status_code == 409 and "running" in again.json()["error"]["message"]

    def load() -> dict[str, Any]:
        state = httpx.get(f"{server.url}/dashboard/state").json()
        return state["load"]  # type: ignore[no-any-return]

    wait_for(lambda: not load()["running"], timeout=60)
    assert load() == {"running": False, "done": total, "failed": 0, "total": total}
    server.wait_idle()


def test_with_an_api_key_the_page_is_open_and_the_data_needs_the_key(
    start_tiny_server: Any,
) -> None:
    keyed = start_tiny_server(api_keys=(API_KEY,))
    header = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{keyed.url}/dashboard").status_code == 200
    assert httpx.get(f"{keyed.url}/dashboard/static/grid.js").status_code == 200
    for path in ("/dashboard/info", "/dashboard/state", "/dashboard/events"):
        assert httpx.get(keyed.url + path).status_code == 401, path
        assert httpx.get(f"{keyed.url}{path}?api_key=wrong").status_code == 401, path
    assert httpx.post(f"{keyed.url}/dashboard/load", json={}).status_code == 401
    assert httpx.get(f"{keyed.url}/dashboard/info", headers=header).status_code == 200
    # Only the event stream takes the key from the query (EventSource sends no headers).
    assert httpx.get(f"{keyed.url}/dashboard/info?api_key={API_KEY}").status_code == 401
    assert httpx.get(f"{keyed.url}/v1/models?api_key={API_KEY}").status_code == 401
    first = next(frames(f"{keyed.url}/dashboard/events?api_key={API_KEY}"))
    assert first["num_blocks"] == keyed.async_engine.engine.kv_cache_manager.num_usable_blocks
    assert next(frames(f"{keyed.url}/dashboard/events", header))["layout"] == "exact"


def test_no_dashboard_serves_neither_page_nor_stream(start_tiny_server: Any) -> None:
    plain = start_tiny_server(enable_dashboard=False)
    for path in ("/dashboard", "/dashboard/events", "/dashboard/static/main.js"):
        assert httpx.get(plain.url + path).status_code == 404, path
    assert plain.app.state.dashboard is None


def test_shutdown_ends_open_dashboard_streams_instead_of_waiting_for_them(
    tiny_model_dir: Any,
) -> None:
    engine = LLMEngine.from_engine_args(str(tiny_model_dir), dtype="float32", num_blocks=64)
    app = build_app(engine, ServerConfig("tiny"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = StreamClosingServer(uvicorn.Config(app, log_level="warning"), app.state.dashboard)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    stream = frames(f"{url}/dashboard/events")
    assert next(stream)["num_blocks"] == 63
    server.should_exit = True
    thread.join(10)
    assert not thread.is_alive(), "shutdown waited on the open stream"
    assert list(stream) == []  # the stream ended, cleanly
    sock.close()
