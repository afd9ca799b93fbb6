"""A replica's refusal is the response's status, streamed or not, as on one process.

A second, small app shares the session's Serve proxy under ``/overload``: one
engine replica that runs one sequence and lets two wait. A single-process
server with the same settings is the reference: both are driven into the same
state (one request running, one waiting), then sent requests the engine must
refuse, and must answer each with the same status, headers and body.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")

from ray_app_fixtures import API_KEY, ENGINE_ARGS, MODEL_NAME, RayApp

from kvserve.engine import LLMEngine
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from live_server import LiveServer
from model_fixtures import TINY_CHAT_TEMPLATE, save_tiny_model, train_tiny_tokenizer

ROUTE = "/overload"
# One running sequence, two waiting: a call of n=2 behind one waiting request is refused.
SEQS_ARGS: dict[str, Any] = {
    **ENGINE_ARGS,
    "max_num_seqs": 1,
    "max_model_len": 8192,
    "num_blocks": 2100,
}
MAX_WAITING = 2
# Still running while the refused requests come and go (several seconds, where they take
# tenths; it is cancelled once they are answered): the reason for the model's long context.
RUNNING = {"prompt": "the quick brown fox", "max_tokens": 8000, "ignore_eos": True}
WAITING = {"prompt": "a cat sleeps in the sun", "max_tokens": 8, "ignore_eos": True}
BASE = {"model": MODEL_NAME, "temperature": 0}


def _server_config() -> ServerConfig:
    return ServerConfig(MODEL_NAME, api_keys=(API_KEY,), max_waiting_requests=MAX_WAITING)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with an 8192-token context."""
    folder = tmp_path_factory.mktemp("tiny-8192")
    return save_tiny_model(folder, "llama", train_tiny_tokenizer(), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def overload_app(ray_app: RayApp, model_dir: Path) -> Iterator[str]:
    """The small app's URL, on ``ray_app``'s proxy (one proxy serves every app)."""
    from ray import serve

    from kvserve.config import EngineConfig
    from kvserve.serve.ray.app import RayServeOptions, build_application
    from kvserve.serve.ray.local_cluster import undeploy

    options = RayServeOptions(replicas=1, routing="round-robin", app_name="kvserve-overload")
    engine_config = EngineConfig.from_kwargs(str(model_dir), **SEQS_ARGS)
    app = build_application(engine_config, _server_config(), options, TINY_CHAT_TEMPLATE)
    try:
        serve.run(app, name=options.app_name, route_prefix=ROUTE)
        yield ray_app.url + ROUTE
    finally:
        undeploy(options)


@pytest.fixture(scope="module")
def single_process(model_dir: Path) -> Iterator[str]:
    engine = LLMEngine.from_engine_args(str(model_dir), **SEQS_ARGS)
    engine.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    server = LiveServer(build_app(engine, _server_config())).start()
    yield server.url
    server.stop()


def _answer(response: httpx.Response) -> tuple[int, str | None, Any]:
    """What a refused request got: its status, Retry-After, and JSON body."""
    response.read()
    is_json = response.headers.get("content-type") == "application/json"
    body = response.json() if is_json else response.text  # an SSE body: wrongly accepted
    return response.status_code, response.headers.get("Retry-After"), body


def _text(events: Iterator[str]) -> tuple[str, str | None]:
    """A completion stream's text and last finish reason, read to ``[DONE]``."""
    text, reason = "", None
    for line in events:
        if line == "data: [DONE]":
            return text, reason
        if line.startswith("data: "):
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    raise AssertionError("the stream ended without [DONE]")


def _scenario(url: str) -> dict[str, Any]:
    """Fill the engine (one running, one waiting), send what it must refuse, then cancel the
    running request and read the waiting one to its end."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    completions, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    answers: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=60, headers=headers))

        def stream(endpoint: str, body: dict[str, Any]) -> httpx.Response:
            return stack.enter_context(client.stream("POST", endpoint, json={**BASE, **body}))

        running = stream(completions, {**RUNNING, "stream": True})
        assert running.status_code == 200
        running_events = running.iter_lines()
        assert next(running_events).startswith("data: ")  # its first step is done: it runs
        # Its 200 comes once the engine has queued it, behind the running one.
        waiting = stream(completions, {**WAITING, "stream": True})
        assert waiting.status_code == 200
        overloaded = {**WAITING, "n": 2}  # 1 waiting + 2 > 2
        answers["stream"] = _answer(stream(completions, {**overloaded, "stream": True}))
        answers["whole"] = _answer(client.post(completions, json={**BASE, **overloaded}))
        messages = [{"role": "user", "content": "hello"}]
        chat_body = {**BASE, "messages": messages, "n": 2, "max_tokens": 4, "stream": True}
        answers["chat stream"] = _answer(stream(chat, chat_body))
        # Never fits (3 sequences, 2 may wait): 400 for the field, found by the engine.
        invalid = {**WAITING, "n": 3}
        answers["invalid stream"] = _answer(stream(completions, {**invalid, "stream": True}))
        answers["invalid whole"] = _answer(client.post(completions, json={**BASE, **invalid}))
        running.close()  # the client leaves: the engine aborts it and runs the waiting one
        answers["waiting"] = _text(waiting.iter_lines())
    return answers


def test_refusals_before_the_first_token_match_single_process(
    overload_app: str, single_process: str
) -> None:
    expected = _scenario(single_process)
    got = _scenario(overload_app)
    for key in ("stream", "whole", "chat stream"):
        status, retry_after, body = expected[key]
        assert (status, retry_after, body["error"]["code"]) == (503, "1", "overloaded"), key
    for key in ("invalid stream", "invalid whole"):
        status, _, body = expected[key]
        assert (status, body["error"]["param"]) == (400, "n"), key
    assert expected["waiting"][1] == "length"
    assert got == expected
