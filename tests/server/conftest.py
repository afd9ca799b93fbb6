"""Live servers for the server tests: uvicorn in a background thread on a free loopback port."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.engine import LLMEngine
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.connection_limits import uvicorn_options
from kvserve.entrypoints.openai.server_config import ServerConfig
from live_server import LiveServer
from model_fixtures import TINY_CHAT_TEMPLATE

TINY_MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[[Any], LiveServer]]:
    """``start_server(app, **uvicorn_options)``: a live server for ``app``, stopped after the module."""
    servers: list[LiveServer] = []

    def start(app: Any, **options: Any) -> LiveServer:
        servers.append(LiveServer(app, **options).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def start_tiny_server(
    tiny_model_dir: Path, start_server: Callable[[Any], LiveServer]
) -> Callable[..., LiveServer]:
    """``start_tiny_server(engine_args={...}, **server_config)``: a live server on the tiny model.

    uvicorn runs with the connection limits of the server config, as ``kvserve serve`` does.
    """

    def start(engine_args: dict[str, Any] | None = None, **config: Any) -> LiveServer:
        args = {"dtype": "float32", "block_size": 4, "num_blocks": 512, "max_model_len": 256}
        engine = LLMEngine.from_engine_args(str(tiny_model_dir), **{**args, **(engine_args or {})})
        engine.tokenizer.chat_template = TINY_CHAT_TEMPLATE
        server_config = ServerConfig(TINY_MODEL_NAME, **config)
        return start_server(build_app(engine, server_config), **uvicorn_options(server_config))

    return start
