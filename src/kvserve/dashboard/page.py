"""The dashboard's page and static files, served from the package, for live and replay alike.

The page is plain HTML, CSS and JavaScript modules under ``static/``: no
build step, nothing fetched from another host, so it works offline. It asks
``GET /dashboard/info`` what it is looking at (a live server or a replayed
trace) and draws the same frames either way.

The page and its static files hold no data, so a server with an API key
serves them to anyone (a browser cannot send a key with a navigation); the
data endpoints stay behind the key (see docs/server.md).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response

PAGE_PATH = "/dashboard"
STATIC_PREFIX = "/dashboard/static/"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _read_static() -> dict[str, tuple[bytes, str]]:
    """Every static file by name, with its media type: a fixed set, so no path is ever joined."""
    files = {}
    for entry in resources.files("kvserve.dashboard").joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _MEDIA_TYPES:
            files[entry.name] = (entry.read_bytes(), _MEDIA_TYPES[suffix])
    return files


def page_paths() -> frozenset[str]:
    """The paths of the page and its static files: open to anyone, they hold no data."""
    names = [name for name in _read_static() if name != "index.html"]
    return frozenset({PAGE_PATH, PAGE_PATH + "/", *(STATIC_PREFIX + name for name in names)})


def install_page(app: FastAPI, info: Callable[[], dict[str, Any]]) -> None:
    """``GET /dashboard``, its static files, and ``GET /dashboard/info`` (``info()``'s dict)."""
    static = _read_static()
    index, _ = static.pop("index.html")
    # The page must never be framed by another site, nor load anything from elsewhere.
    headers = {
        "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
        "Cache-Control": "no-cache",
    }

    @app.get(PAGE_PATH, include_in_schema=False)
    @app.get(PAGE_PATH + "/", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(index, media_type=_MEDIA_TYPES[".html"], headers=headers)

    @app.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        found = static.get(name)
        if found is None:
            raise HTTPException(404, f"no static file {name!r}")
        content, media_type = found
        return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})

    @app.get(PAGE_PATH + "/info", include_in_schema=False)
    async def dashboard_info() -> Response:
        return JSONResponse(info())
