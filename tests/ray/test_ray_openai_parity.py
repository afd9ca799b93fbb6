"""The Ray Serve app answers exactly as the single-process server on the same tiny model.

Both serve the same weights with the same engine settings; greedy decoding makes
the outputs comparable token for token, through the official ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")

import openai
from ray_app_fixtures import API_KEY, ENGINE_ARGS, MODEL_NAME, RayApp

from kvserve.engine import LLMEngine
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from live_server import LiveServer
from model_fixtures import TINY_CHAT_TEMPLATE

PROMPTS = ["the quick brown fox", "a cat sleeps in the sun while"]
MESSAGES = [{"role": "user", "content": "tell me about the lazy dog"}]
GREEDY: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def single_process(tiny_model_dir: Path) -> Iterator[LiveServer]:
    engine = LLMEngine.from_engine_args(str(tiny_model_dir), **ENGINE_ARGS)
    engine.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    server = LiveServer(build_app(engine, ServerConfig(MODEL_NAME, api_keys=(API_KEY,)))).start()
    yield server
    server.stop()


def _clients(ray_app: RayApp, single_process: LiveServer) -> list[openai.OpenAI]:
    return [
        openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        for url in (single_process.url, ray_app.url)
    ]


def test_completions_match_single_process(ray_app: RayApp, single_process: LiveServer) -> None:
    answers = [
        [c.text for c in client.completions.create(prompt=PROMPTS, **GREEDY).choices]
        for client in _clients(ray_app, single_process)
    ]
    assert answers[0] == answers[1]
    assert all(answers[0])


def test_streamed_completions_match_single_process(
    ray_app: RayApp, single_process: LiveServer
) -> None:
    answers = []
    for client in _clients(ray_app, single_process):
        chunks = client.completions.create(prompt=PROMPTS[1], stream=True, **GREEDY)
        answers.append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))
    assert answers[0] == answers[1] != ""


def test_chat_matches_single_process(ray_app: RayApp, single_process: LiveServer) -> None:
    answers = []
    for client in _clients(ray_app, single_process):
        whole = client.chat.completions.create(messages=MESSAGES, **GREEDY)  # type: ignore[arg-type]
        chunks = client.chat.completions.create(messages=MESSAGES, stream=True, **GREEDY)  # type: ignore[arg-type]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        answers.append((whole.choices[0].message.content, streamed))
    assert answers[0] == answers[1]
    assert answers[0][0] == answers[0][1] != ""


def test_wrong_api_key_gets_the_same_401(ray_app: RayApp, single_process: LiveServer) -> None:
    responses = [
        httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hello", "max_tokens": 2},
            headers={"Authorization": "Bearer wrong"},
            timeout=10,
        )
        for url in (single_process.url, ray_app.url)
    ]
    assert [r.status_code for r in responses] == [401, 401]
    assert responses[0].json() == responses[1].json()
    assert httpx.get(f"{ray_app.url}/health", timeout=10).status_code == 200  # open for probes


def test_bad_request_gets_the_same_400(ray_app: RayApp, single_process: LiveServer) -> None:
    body = {"prompt": "hello", "max_tokens": 10_000, "model": MODEL_NAME}
    responses = [
        httpx.post(f"{url}/v1/completions", json=body, headers=ray_app.headers, timeout=10)
        for url in (single_process.url, ray_app.url)
    ]
    assert [r.status_code for r in responses] == [400, 400]
    assert responses[0].json() == responses[1].json()


def test_metrics_are_per_replica_and_summed(ray_app: RayApp) -> None:
    totals = ray_app.samples("kvserve_kv_cache_blocks_total")
    per_replica = {replica: value for replica, value in totals.items() if replica}
    assert len(per_replica) == 2
    assert totals[""] == sum(per_replica.values()) > 0
