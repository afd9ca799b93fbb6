"""The OpenAI-compatible HTTP server: the FastAPI app and its routes.

``build_app(engine, config)`` wraps a loaded :class:`LLMEngine` in an
:class:`AsyncEngine` (started and stopped with the app) and serves:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE),
- ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` (see
  ``serving_responses.py``),
- ``POST /v1/embeddings`` (an embedding model, a decoder under ``--task embed``,
  or the model beside the generator that ``--embedding-model`` adds),
- ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes),
- ``GET /v1/models``, ``GET /metrics`` (Prometheus text),
- ``GET /dashboard`` and its state stream, unless ``enable_dashboard`` is
  off (see ``dashboard_routes.py``),
- ``GET /health``: 200 while the engine loop runs, 503 otherwise; never
  needs the API key, so load balancers can probe it,
- ``GET /openapi.json`` (behind the key, like everything but /health), and
  the ``/docs`` and ``/redoc`` pages only when there is no key: they fetch
  the schema from a browser, which sends no key, so behind one they could
  not work.

Run it with ``kvserve serve --model ...`` (see ``cli_serve.py``). Everything
is built per app, so tests can run several.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve import __version__
from kvserve.dashboard.live import LiveDashboard
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.disk_tier import tenant_salt_secret
from kvserve.engine.engine_client import EngineClient
from kvserve.engine.iteration_stats import IterationStats
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.api_errors import ApiError, install_error_handlers
from kvserve.entrypoints.openai.auth import OPEN_PATHS, ApiKeyMiddleware, ApiKeys
from kvserve.entrypoints.openai.dashboard_routes import QUERY_KEY_PATHS, install_dashboard_routes
from kvserve.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.entrypoints.openai.openapi_doc import install_openapi
from kvserve.entrypoints.openai.protocol import ModelCard, ModelList
from kvserve.entrypoints.openai.response_store import ResponseStore
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.entrypoints.openai.serving_chat import ChatServing
from kvserve.entrypoints.openai.serving_completion import CompletionServing
from kvserve.entrypoints.openai.serving_embedding import EmbeddingRouter, EmbeddingServing
from kvserve.entrypoints.openai.serving_responses import install_responses_routes
from kvserve.entrypoints.openai.serving_tokenize import TokenizeServing


def build_app(
    engine: LLMEngine,
    config: ServerConfig,
    embedding_engine: LLMEngine | None = None,
    embedding_model_name: str | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine``; its loop thread runs while the app is up.

    embedding_engine: an embedding model served beside ``engine`` under
    ``embedding_model_name``; the two engines' steps take turns on one loop thread.
    """
    metrics = ServerMetrics(config.served_model_name)
    metrics.kv_blocks_total.set(engine.kv_cache_manager.num_usable_blocks)
    dashboard = LiveDashboard(engine, config.served_model_name) if config.enable_dashboard else None

    def observe(stats: IterationStats) -> None:
        metrics.observe(stats)
        if dashboard is not None:
            dashboard.observe(stats)

    async_engine = AsyncEngine(engine, config.max_waiting_requests, observe)

    async def render_metrics() -> bytes:
        return metrics.render()

    embedder = None
    if embedding_engine is not None:
        name = embedding_model_name or embedding_engine.config.model_config.model
        # On the generator's loop thread: their steps take turns, with every core each.
        follower = AsyncEngine(
            embedding_engine, config.max_waiting_requests, share_thread_with=async_engine
        )
        embedder = (follower, name)
    salt_secret = None
    if config.salt_cache_by_api_key and engine.disk_tier is not None:
        salt_secret = tenant_salt_secret(engine.disk_tier.store)
    return build_app_for(async_engine, config, render_metrics, dashboard, embedder, salt_secret)


def build_app_for(
    async_engine: EngineClient,
    config: ServerConfig,
    render_metrics: Callable[[], Awaitable[bytes]],
    dashboard: LiveDashboard | None = None,
    embedder: tuple[EngineClient, str] | None = None,
    salt_secret: bytes | None = None,
) -> FastAPI:
    """The app's routes over ``async_engine`` (started and stopped with the app).

    embedder: a second engine that serves embeddings, and its served model name.
    salt_secret: the secret of ``--salt-cache-by-api-key``'s salts when they must
    outlive the process (a disk tier); None draws one.

    render_metrics: the Prometheus text of ``GET /metrics``.
    Also used by the Ray Serve ingress, whose engine client relays to other processes
    (``kvserve/serve/ray/remote_engine.py``).
    """
    # Tokenizing and rendering chat templates, off the event loop. One thread: the
    # work holds the GIL for much of its time, so more threads would not go faster.
    tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if dashboard is not None:
            dashboard.start()
        async_engine.start()
        if embedder is not None:
            embedder[0].start()
        try:
            yield
        finally:
            if dashboard is not None:
                await dashboard.stop()
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            # Joining the loop thread blocks; keep the event loop free meanwhile.
            await asyncio.to_thread(async_engine.shutdown)
            if embedder is not None:
                await asyncio.to_thread(embedder[0].shutdown)

    no_docs: dict[str, Any] = {"docs_url": None, "redoc_url": None} if config.api_keys else {}
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, **no_docs)
    if config.api_keys:
        keys = ApiKeys(config.api_keys, config.salt_cache_by_api_key, salt_secret)
        open_paths, query_key_paths = OPEN_PATHS, frozenset[str]()
        if dashboard is not None:
            open_paths, query_key_paths = open_paths | dashboard.open_paths(), QUERY_KEY_PATHS
        app.add_middleware(
            ApiKeyMiddleware, keys=keys, open_paths=open_paths, query_key_paths=query_key_paths
        )
    app.state.async_engine = async_engine
    app.state.dashboard = dashboard
    if dashboard is not None:
        dashboard.connect(async_engine, tokenizer_pool)
        install_dashboard_routes(app, dashboard)
    install_error_handlers(app)
    install_openapi(app, has_api_keys=bool(config.api_keys))
    completions = CompletionServing(async_engine, config, tokenizer_pool)
    chat = ChatServing(async_engine, config, tokenizer_pool)
    tokenizing = TokenizeServing(chat)
    install_responses_routes(app, chat, ResponseStore())
    embedding_servings = [EmbeddingServing(async_engine, config, tokenizer_pool)]
    if embedder is not None:
        embedder_config = dataclasses.replace(config, served_model_name=embedder[1])
        embedding_servings.append(EmbeddingServing(embedder[0], embedder_config, tokenizer_pool))
    embeddings = EmbeddingRouter(embedding_servings)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return ApiError(503, "The engine is not running.", code="engine_unavailable").response()

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(
            id=config.served_model_name,
            created=created,
            max_model_len=async_engine.limits.max_model_len,
        )
        cards = [card]
        if embedder is not None:
            limits = embedder[0].limits
            cards.append(
                ModelCard(id=embedder[1], created=created, max_model_len=limits.max_model_len)
            )
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await render_metrics(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.create(request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(request)

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request) -> Response:
        return await embeddings.create(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokenizing.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokenizing.detokenize(request)

    return app
