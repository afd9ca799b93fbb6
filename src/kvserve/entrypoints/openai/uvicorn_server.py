"""uvicorn's server, ending the dashboard's endless streams as soon as shutdown begins.

A graceful shutdown first waits for every response to end, and only then
runs the app's lifespan shutdown. A dashboard's state stream never ends by
itself, so without this Ctrl-C would wait for every open dashboard tab to
be closed.
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

from kvserve.dashboard.live import LiveDashboard


class StreamClosingServer(uvicorn.Server):
    """A ``uvicorn.Server`` that closes ``dashboard``'s streams before it waits for responses."""

    def __init__(self, config: uvicorn.Config, dashboard: LiveDashboard | None) -> None:
        super().__init__(config)
        self.dashboard = dashboard

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.dashboard is not None:
            self.dashboard.hub.close()
        await super().shutdown(sockets)


def serve(app: Any, **options: Any) -> None:
    """``uvicorn.run(app, **options)``, through a :class:`StreamClosingServer`.

    ``app.state.dashboard`` (a LiveDashboard, or None) names the streams to close.
    """
    StreamClosingServer(uvicorn.Config(app, **options), app.state.dashboard).run()
