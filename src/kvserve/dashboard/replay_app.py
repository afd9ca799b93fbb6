"""``kvserve dashboard --trace FILE``: the dashboard's page over a recorded step trace.

The same page as ``kvserve serve``'s ``/dashboard``, in replay mode: it asks
``GET /dashboard/info`` for the number of frames and fetches them a page at
a time from ``GET /dashboard/replay/frames?start=I&count=N``, with play,
pause, step, speed and seek controls. Frames are built once, when the
command starts (see ``replay.py``); nothing else is served.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.responses import Response

from kvserve.dashboard.page import PAGE_PATH, install_page
from kvserve.dashboard.replay import TraceReplay
from kvserve.errors import InvalidParameterError
from kvserve.trace.reader import read_trace

MAX_FRAMES_PER_PAGE = 500
REPLAY_NOTE = (
    "Block positions are simulated (a trace records counts, not block ids) and shared "
    "prefixes between requests are not shown; totals are the trace's own."
)


def build_replay_app(path: str | Path, run: int = 0) -> FastAPI:
    """An app that replays run ``run`` of the trace at ``path``; InvalidParameterError if bad."""
    runs = read_trace(path)
    if not runs:
        raise InvalidParameterError("trace", f"{str(path)!r} holds no run")
    if not 0 <= run < len(runs):
        raise InvalidParameterError("run", f"must be in [0, {len(runs) - 1}], got {run}")
    replay = TraceReplay(runs[run])
    frames = replay.frames
    info = {
        "mode": "replay",
        "model": replay.header["model"],
        "trace": Path(path).name,
        "run": run,
        "num_runs": len(runs),
        "num_frames": len(frames),
        "note": REPLAY_NOTE,
    }
    app = FastAPI(title="kvserve dashboard replay", docs_url=None, redoc_url=None, openapi_url=None)
    install_page(app, lambda: info)

    @app.get(PAGE_PATH + "/replay/frames")
    async def replay_frames(
        start: int = Query(0, ge=0), count: int = Query(100, ge=1, le=MAX_FRAMES_PER_PAGE)
    ) -> Response:
        page = frames[start : start + count]
        body = b'{"start":%d,"total":%d,"frames":[' % (start, len(frames))
        return Response(body + b",".join(page) + b"]}", media_type="application/json")

    return app
