"""The live dashboard of ``kvserve serve``: the pieces it wires together.

A sampler on the engine loop, the hub that streams its frames, and the
built-in load. Its HTTP routes are the server's
(``entrypoints/openai/dashboard_routes.py``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from kvserve.dashboard.hub import StateHub
from kvserve.dashboard.load import BuiltinLoad
from kvserve.dashboard.page import page_paths
from kvserve.dashboard.sampler import EngineStateSampler
from kvserve.engine.engine_client import EngineClient
from kvserve.engine.iteration_stats import IterationStats
from kvserve.engine.llm_engine import LLMEngine


class LiveDashboard:
    """The state stream of one server: a sampler on the engine loop, a hub, the load button.

    Build it before the AsyncEngine (its :meth:`observe` is one of the engine's
    stats observers), then :meth:`connect` the AsyncEngine and install the routes
    (``install_dashboard_routes``). :meth:`start` and :meth:`stop` belong in the
    app's lifespan.
    """

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.hub = StateHub(extra=self.load_status)
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

    def connect(self, async_engine: EngineClient, tokenizer_pool: Executor) -> None:
        self.load = BuiltinLoad(async_engine, tokenizer_pool, on_change=self.hub.refresh)

    def start(self) -> None:
        """Bind the hub to the running event loop; before the engine loop starts."""
        self.hub.attach(asyncio.get_running_loop())

    async def stop(self) -> None:
        """End the streams and the load (shutdown)."""
        self.hub.close()
        if self.load is not None:
            await self.load.stop()

    def load_status(self) -> dict[str, object]:
        """The built-in load's progress, added to every frame (empty before :meth:`connect`)."""
        return {} if self.load is None else self.load.status()
