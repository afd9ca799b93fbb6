"""A live uvicorn server for tests: a background thread on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn


class LiveServer:
    """A real uvicorn server around ``app``, reachable at ``self.url``; ``options`` go to uvicorn."""

    def __init__(self, app: Any, **options: Any) -> None:
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", **options
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def async_engine(self) -> Any:
        return self.app.state.async_engine

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the engine holds no request and every KV block is free."""
        engine = self.async_engine.engine
        manager = engine.kv_cache_manager
        deadline = time.monotonic() + timeout
        while engine.has_unfinished_requests() or manager.num_free_blocks != (
            manager.num_usable_blocks
        ):
            assert time.monotonic() < deadline, "the engine did not drain"
            time.sleep(0.01)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of ``/metrics`` (labels besides model_name must match)."""
        headers = getattr(self, "headers", {})
        text = httpx.get(f"{self.url}/metrics", headers=headers).text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"metric {name} {labels} not found")
