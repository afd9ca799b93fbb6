"""The ingress starts no response before its replica has answered a call.

``RemoteAsyncEngine`` runs here over a stand-in for the engine deployment's
handle, whose items are pickled as Ray carries them: no cluster, so the
replica's answers (a dead engine, a lost actor, no answer yet) are chosen.
"""

from __future__ import annotations

import asyncio
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")

from kvserve.engine import LLMEngine
from kvserve.engine.async_errors import EngineDeadError
from kvserve.entrypoints.openai.api_server import build_app, build_app_for
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.sampling_params import SamplingParams
from kvserve.serve.ray.engine_replica import engine_facts
from kvserve.serve.ray.remote_engine import EngineFront, RemoteAsyncEngine
from live_server import LiveServer

MODEL_NAME = "tiny"
REQUEST = {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 4}
LOST = "lost"  # an item that stands for the replica's actor dying: the call raises


class _Call:
    """What ``handle.generate.remote`` returns: the chosen items, then the end (or nothing)."""

    def __init__(self, items: list[Any], hang: bool) -> None:
        self._items = [pickle.loads(pickle.dumps(item)) for item in items]
        self._hang = hang
        self.cancelled = False

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        if not self._items:
            if self._hang:
                await asyncio.Event().wait()
            raise StopAsyncIteration
        item = self._items.pop(0)
        if item == LOST:
            raise RuntimeError("the replica's actor died")
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """The engine deployment's handle; every call answers ``items`` (then hangs if ``hang``)."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.hang = False
        self.calls: list[_Call] = []
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, **_: Any) -> _Handle:
        return self

    def _remote(self, requests: list[Any]) -> _Call:
        self.calls.append(_Call(self.items, self.hang))
        return self.calls[-1]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(str(tiny_model_dir), dtype="float32", num_blocks=64)


@pytest.fixture(scope="module")
def handle() -> _Handle:
    return _Handle()


@pytest.fixture(scope="module")
def remote(engine: LLMEngine, handle: _Handle) -> RemoteAsyncEngine:
    return RemoteAsyncEngine(EngineFront(engine_facts(engine)), cast(Any, handle))


@pytest.fixture(scope="module")
def ingress(remote: RemoteAsyncEngine) -> Iterator[str]:
    """The ingress's app over the stand-in handle, on a live server."""

    async def no_metrics() -> bytes:
        return b""

    app = build_app_for(remote, ServerConfig(MODEL_NAME), no_metrics)
    server = LiveServer(app).start()
    yield server.url
    server.stop()


def _post(url: str, stream: bool) -> tuple[int, str | None, str, Any]:
    """Status, Retry-After, content type, and the body with its error id masked."""
    response = httpx.post(f"{url}/v1/completions", json={**REQUEST, "stream": stream}, timeout=30)
    kind = response.headers["content-type"]
    body = re.sub(r"error id \w+", "error id X", response.text)
    return response.status_code, response.headers.get("Retry-After"), kind, body


def test_a_dead_replica_engine_answers_503_as_one_process_does(
    engine: LLMEngine, handle: _Handle, ingress: str
) -> None:
    single = LiveServer(build_app(engine, ServerConfig(MODEL_NAME))).start()
    try:
        single.async_engine.shutdown()  # what a replica whose loop ended refuses with
        expected = [_post(single.url, stream) for stream in (True, False)]
    finally:
        single.stop()
    handle.items, handle.hang = [EngineDeadError("shut down")], False
    assert [_post(ingress, stream) for stream in (True, False)] == expected
    assert expected[0][:3] == (503, None, "application/json")
    assert '"engine_unavailable"' in expected[0][3]


def test_a_replica_lost_before_answering_is_a_500_not_a_stream(
    handle: _Handle, ingress: str
) -> None:
    handle.items, handle.hang = [LOST], False
    for stream in (True, False):
        status, _, kind, body = _post(ingress, stream)
        assert (status, kind) == (500, "application/json")
        assert '"generation_failed"' in body


def test_leaving_before_the_answer_cancels_the_call(
    remote: RemoteAsyncEngine, handle: _Handle
) -> None:
    handle.items, handle.hang = [], True  # the replica has not answered yet
    first_call = len(handle.calls)  # the earlier tests' calls come before this one's

    async def until(condition: Callable[[], bool]) -> None:
        while not condition():
            await asyncio.sleep(0.01)

    async def leave() -> None:
        remote.start()
        prepared = remote.prepare("left", [1, 2, 3], SamplingParams(max_tokens=2))
        waiting = asyncio.ensure_future(remote.generate([prepared]).accepted())
        await asyncio.wait_for(until(lambda: len(handle.calls) > first_call), 10)
        waiting.cancel()  # the client left: the route's task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # The pump sees its cancellation at its next turn.
        await asyncio.wait_for(until(lambda: handle.calls[first_call].cancelled), 10)

    asyncio.run(leave())
    assert len(handle.calls) == first_call + 1 and handle.calls[first_call].cancelled
    assert "left" not in remote._calls
