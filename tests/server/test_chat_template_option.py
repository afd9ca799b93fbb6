"""A model without a chat template (a base model) gets 400 on the chat endpoint unless serve has --chat-template."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.cli import build_parser
from kvserve.engine import LLMEngine
from kvserve.entrypoints.openai import cli_serve, uvicorn_server
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from model_fixtures import TINY_CHAT_TEMPLATE

ENGINE_ARGS: dict[str, Any] = {"dtype": "float32", "block_size": 4, "num_blocks": 128}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_chat_without_a_template_is_refused_and_completions_still_work(
    tiny_model_dir: Path, start_server: Callable[..., Any]
) -> None:
    engine = LLMEngine.from_engine_args(str(tiny_model_dir), **ENGINE_ARGS)
    assert not engine.tokenizer.chat_template
    server = start_server(build_app(engine, ServerConfig("tiny")))
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    completion = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert completion.status_code == 200


def test_serve_installs_the_chat_template_option(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, start_server: Callable[..., Any]
) -> None:
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn_server, "serve", lambda app, **options: apps.append(app))
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the test process goes on afterwards
    engine_flags = ["--dtype", "float32", "--num-blocks", "128", "--block-size", "4"]
    template_flags = ["--chat-template", TINY_CHAT_TEMPLATE]
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir), *engine_flags, *template_flags]
    )
    assert cli_serve.run_serve(args) == 0
    server = start_server(apps[0])
    assert server.async_engine.tokenizer.chat_template == TINY_CHAT_TEMPLATE
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_serve_refuses_a_chat_template_that_is_neither_file_nor_template(
    tiny_model_dir: Path,
) -> None:
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir), "--chat-template", "no-such-file.jinja"]
    )
    with pytest.raises(SystemExit, match="chat_template"):
        cli_serve.run_serve(args)
