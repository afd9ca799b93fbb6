"""The live dashboard's HTTP routes on the OpenAI server (the dashboard is in ``kvserve/dashboard/``).

Routes (all but the page behind the API key when one is set):

- ``GET /dashboard``, ``/dashboard/static/*``: the page (see ``dashboard/page.py``).
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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.dashboard.live import LiveDashboard
from kvserve.dashboard.page import PAGE_PATH, install_page
from kvserve.entrypoints.openai.api_errors import ApiError, require_json_body

EVENTS_PATH = PAGE_PATH + "/events"
# Paths that take the API key as a query parameter (EventSource sends no headers).
QUERY_KEY_PATHS = frozenset({EVENTS_PATH})


def install_dashboard_routes(app: FastAPI, dashboard: LiveDashboard) -> None:
    """Add ``dashboard``'s routes to ``app``; ``dashboard`` must be connected to its engine."""
    install_page(app, lambda: {"mode": "live", "model": dashboard.model_name})
    hub = dashboard.hub

    @app.get(PAGE_PATH + "/state", include_in_schema=False)
    async def dashboard_state() -> Response:
        frame = None if hub.latest is None else {**hub.latest, **dashboard.load_status()}
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
        load = dashboard.load
        assert load is not None, "connect() the AsyncEngine before serving"
        if not load.start():
            raise ApiError(409, "A load is running already; wait for it to finish.")
        return JSONResponse(load.status(), status_code=202)
