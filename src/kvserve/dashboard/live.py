"""The live dashboard of ``kvserve serve``: its routes, and the pieces it wires together.

Routes (all but the page behind the API key when one is set):

- ``GET /dashboard``, ``/dashboard/static/*``: the page (see ``page.py``).
- ``GET /dashboard/info``: ``{"mode": "live", "model": ...}``.
- ``GET /dashboard/state``: the latest frame as JSON (null before the first).
- ``GET /dashboard/events``: the frames as Server-Sent Events, at most ~10 a
  second; a browser's EventSource cannot send headers, so this path also
  takes the key as an ``api_key`` query parameter.
- ``POST /dashboard/load``: start the built-in load (202), or 409 while one
  runs. It needs ``Content-Type: application/json``, which a page on another
  site cannot send without a CORS preflight that this server never grants
  (``require_json_body``, the API routes' rule too).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.dashboard.hub import StateHub
from kvserve.dashboard.load import BuiltinLoad
from kvserve.dashboard.page import PAGE_PATH, install_page, page_paths
from kvserve.dashboard.sampler import EngineStateSampler
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.iteration_stats import IterationStats
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.api_errors import ApiError, require_json_body

EVENTS_PATH = PAGE_PATH + "/events"
# Paths that take the API key as a query parameter (EventSource sends no headers).
QUERY_KEY_PATHS = frozenset({EVENTS_PATH})


class LiveDashboard:
    """The state stream of one server: a sampler on the engine loop, a hub, the load button.

    Build it before the AsyncEngine (its :meth:`observe` is one of the engine's
    stats observers), then :meth:`connect` the AsyncEngine and :meth:`install`
    the routes. :meth:`start` and :meth:`stop` belong in the app's lifespan.
    """

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.hub = StateHub(extra=self._extra)
        self.sampler = EngineStateSampler(
            engine, self.hub.publish_threadsafe, self.hub.has_watchers
        )
        self.load: BuiltinLoad | None = None

    @staticmethod
    def open_paths() -> frozenset[str]:
        """Paths anyone may reach: the page and its static files."""
        return page_paths()

    def observe(self, stats: IterationStats) -> None:
        """The AsyncEngine's stats observer (on its loop thread)."""
        self.sampler.observe(stats)

    def connect(self, async_engine: AsyncEngine, tokenizer_pool: Executor) -> None:
        self.load = BuiltinLoad(async_engine, tokenizer_pool, on_change=self.hub.refresh)

    def start(self) -> None:
        """Bind the hub to the running event loop; before the engine loop starts."""
        self.hub.attach(asyncio.get_running_loop())

    async def stop(self) -> None:
        """End the streams and the load (shutdown)."""
        self.hub.close()
        if self.load is not None:
            await self.load.stop()

    def _extra(self) -> dict[str, object]:
        return {} if self.load is None else self.load.status()

    def install(self, app: FastAPI) -> None:
        """Add the dashboard's routes to ``app``."""
        install_page(app, lambda: {"mode": "live", "model": self.model_name})
        hub = self.hub

        @app.get(PAGE_PATH + "/state", include_in_schema=False)
        async def dashboard_state() -> Response:
            frame = None if hub.latest is None else {**hub.latest, **self._extra()}
            return JSONResponse(frame)

        @app.get(EVENTS_PATH, include_in_schema=False)
        async def dashboard_events() -> Response:
            return StreamingResponse(
                hub.events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        @app.post(PAGE_PATH + "/load", include_in_schema=False)
        async def dashboard_load(request: Request) -> Response:
            require_json_body(request)
            assert self.load is not None, "connect() the AsyncEngine before serving"
            if not self.load.start():
                raise ApiError(409, "A load is running already; wait for it to finish.")
            return JSONResponse(self.load.status(), status_code=202)
