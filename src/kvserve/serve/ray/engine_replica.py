"""The engine deployment: one ``AsyncEngine`` per Ray Serve replica.

The ingress sends each call's validated requests (``PreparedRequest``, token ids
included) and reads the deltas back as a stream; cancelling that stream (the
client left) cancels :meth:`EngineReplica.generate` here, and leaving its
``async with`` aborts the requests, which frees their KV blocks before the next
step. The stream opens with :class:`Accepted` once the engine has queued the
call, or with the refusal alone (overloaded, invalid, engine down): the ingress
waits for that first item before it starts a response, so a refusal is the
response's status. Engine errors travel as stream items, not as exceptions, so
the ingress maps them to the same HTTP errors as the single-process server.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve

from kvserve.config import EngineConfig, KVEventsConfig
from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.async_errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from kvserve.engine.engine_client import EngineLimits
from kvserve.engine.iteration_stats import IterationStats
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.output_stream import RequestDelta
from kvserve.engine.own_thread import build_on_own_thread
from kvserve.entrypoints.openai.metrics import ServerMetrics
from kvserve.errors import InvalidParameterError
from kvserve.serve.ray.kv_aware_router import KV_EVENTS_ENDPOINT_KEY
from kvserve.serve.ray.metrics_board import MetricsPublisher

# Errors a replica hands to the ingress as stream items, which the serving layer maps
# to HTTP statuses: a call's refusal (503 overloaded or engine down, 400 invalid) and
# an accepted call's failure (500 failed, 503 engine down).
REFUSALS = (EngineOverloadedError, EngineDeadError, InvalidParameterError)
FAILURES = (EngineDeadError, RequestFailedError)


@dataclass(frozen=True)
class Accepted:
    """The first item of an accepted call's stream: the engine has queued its requests."""


@dataclass(frozen=True)
class EngineFacts:
    """What the ingress needs to validate requests exactly as a replica would."""

    config: EngineConfig
    limits: EngineLimits
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    enable_caching: bool
    sliding_windows: tuple[int | None, ...]


class EngineReplica:
    """One engine on ``num_threads`` torch threads; the body of the engine deployment.

    engine_config: the engine every replica builds.
    served_model_name: the ``model_name`` label of its metrics.
    max_waiting_requests: as the single-process server's (per replica here).
    num_threads: torch / OpenMP threads of the engine loop.
    board_name: the name of the metrics board this replica publishes to.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        served_model_name: str,
        max_waiting_requests: int,
        num_threads: int,
        board_name: str,
    ) -> None:
        parallel = dataclasses.replace(engine_config.parallel_config, num_threads=num_threads)
        local_rank = serve.get_replica_context().rank.local_rank
        config = dataclasses.replace(
            engine_config,
            parallel_config=parallel,
            kv_events_config=replica_kv_events(engine_config.kv_events_config, local_rank),
        )
        engine = build_on_own_thread(lambda: LLMEngine(config))
        gc.collect()
        gc.freeze()
        self._engine = engine
        self._metrics = ServerMetrics(served_model_name)
        self._metrics.kv_blocks_total.set(engine.kv_cache_manager.num_usable_blocks)
        replica_id = serve.get_replica_context().replica_id.unique_id
        self._publisher = MetricsPublisher(board_name, replica_id, self._metrics.render)
        self._async_engine = AsyncEngine(engine, max_waiting_requests, self._observe)
        self._async_engine.start()

    def _observe(self, stats: IterationStats) -> None:
        self._metrics.observe(stats)
        self._publisher.mark_changed()

    async def facts(self) -> EngineFacts:
        """The engine's fixed limits, for the ingress's checks."""
        return engine_facts(self._engine)

    async def generate(
        self, requests: list[PreparedRequest]
    ) -> AsyncIterator[Accepted | RequestDelta | BaseException]:
        """:class:`Accepted` then the deltas of ``requests``, or the refusal alone;
        an engine error ends the stream as its last item."""
        try:
            stream = self._async_engine.generate(requests)
        except REFUSALS as exc:
            yield exc
            return
        async with stream:
            yield Accepted()
            try:
                async for delta in stream:
                    yield delta
            except FAILURES as exc:
                yield exc

    async def metrics(self) -> bytes:
        """This replica's Prometheus text."""
        return self._metrics.render()

    def record_replica_metadata(self) -> dict[str, str]:
        """Ray Serve reads this once, when the replica is ready, and hands it to the
        routers: where this replica publishes its KV cache events (nothing when off)."""
        publisher = self._engine.kv_event_publisher
        if publisher is None:
            return {}
        return {KV_EVENTS_ENDPOINT_KEY: reachable_endpoint(publisher.endpoint)}

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine loop restarts the replica."""
        if not self._async_engine.is_healthy:
            raise RuntimeError("the engine loop is not running")

    def __del__(self) -> None:
        self._async_engine.shutdown(timeout=5.0)


def engine_facts(engine: LLMEngine) -> EngineFacts:
    """``engine``'s fixed limits."""
    manager = engine.kv_cache_manager
    return EngineFacts(
        config=engine.config,
        limits=engine.limits,
        eos_token_ids=engine.eos_token_ids,
        num_blocks=engine.runner.num_blocks,
        enable_caching=manager.enable_caching,
        sliding_windows=tuple(engine.runner.sliding_windows),
    )


def replica_env(num_threads: int) -> dict[str, str]:
    """Environment for a replica's worker process: its OpenMP team size, set before torch loads."""
    return {"OMP_NUM_THREADS": str(num_threads)}


def replica_kv_events(events: KVEventsConfig, local_rank: int) -> KVEventsConfig:
    """A replica's KV event sockets: the configured ports plus its rank on the node.

    Replicas on one node cannot bind the same port, so the replica of local rank
    r publishes on port + r (and replays on replay port + r), as data-parallel
    ranks do in other engines; replicas on other nodes use the same numbers on
    their own hosts. A ``*`` port (any free port) is left as it is.
    """
    return dataclasses.replace(
        events,
        kv_events_endpoint=_offset_port(events.kv_events_endpoint, local_rank),
        kv_events_replay_endpoint=_offset_port(events.kv_events_replay_endpoint, local_rank),
    )


def reachable_endpoint(bound: str) -> str:
    """The address others connect to for a socket bound at ``bound``: a wildcard
    host (``tcp://0.0.0.0:5557``, ``tcp://*:5557``) becomes this node's IP."""
    host, _, port = bound.rpartition(":")
    if host in ("tcp://0.0.0.0", "tcp://*", "tcp://[::]"):
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"
    return bound


def _offset_port(endpoint: str | None, offset: int) -> str | None:
    """``tcp://host:5557`` with offset 2 → ``tcp://host:5559``; others unchanged."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + offset}" if port.isdigit() else endpoint
