"""The OpenAI ingress deployment: ``build_app``'s routes over the engine replicas.

The app is built at replica start (``__serve_build_asgi_app__``), once an engine
replica has told its limits: the routes, validation, errors, SSE streaming and
API key are the single-process server's own code (``build_app_for``); only the
engine (:class:`RemoteAsyncEngine`) and ``/metrics`` (the replicas' series,
summed and per replica) differ. The live dashboard needs the engine in process,
so it is off here.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from kvserve.entrypoints.openai.api_server import build_app_for
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.serve.ray import metrics_board
from kvserve.serve.ray.engine_replica import EngineFacts
from kvserve.serve.ray.remote_engine import EngineFront, RemoteAsyncEngine


@serve.ingress()
class OpenAIIngress:
    """The HTTP entry of the app (the body of the ingress deployment).

    engine: the engine deployment's handle (its request router picks the replica).
    config: the server's settings; ``enable_dashboard`` must be off.
    board_name: the metrics board the replicas publish to.
    chat_template: replaces the model's chat template when given.
    """

    def __init__(
        self,
        engine: DeploymentHandle,
        config: ServerConfig,
        board_name: str,
        chat_template: str | None = None,
    ) -> None:
        if config.enable_dashboard:
            raise ValueError("enable_dashboard must be False: the dashboard needs a local engine")
        self._engine = engine
        self._config = config
        self._board = metrics_board.board_actor(board_name)
        self._chat_template = chat_template

    async def __serve_build_asgi_app__(self) -> FastAPI:
        facts: EngineFacts = await self._engine.facts.remote()
        # Loading the tokenizer takes a while: keep the replica's event loop free.
        front = await asyncio.to_thread(EngineFront, facts, self._chat_template)
        remote = RemoteAsyncEngine(front, self._engine)
        return build_app_for(remote, self._config, self._render_metrics)

    async def _render_metrics(self) -> bytes:
        texts: dict[str, str] = await self._board.snapshot.remote()
        return metrics_board.render(texts)
