"""The KV-aware router's choices, without a cluster: fake replicas, real Ray router code,
and the replicas' block sets fed with hand-built event batches."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")
pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from kvserve.config import EngineConfig
from kvserve.core.block_hash import BlockHash, extend_block_hashes
from kvserve.core.kv_events import BlockRemoved, BlockStored, KVEventBatch
from kvserve.engine.async_commands import PreparedRequest
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams
from kvserve.serve.ray.app import RayServeOptions, build_application
from kvserve.serve.ray.kv_aware_router import KV_EVENTS_ENDPOINT_KEY, KVAwareRouter

DEPLOYMENT = DeploymentID(name="KVServeEngine", app_name="kvserve")
BLOCK = 4
SATURATION = 3
PREFIX = list(range(10, 10 + 3 * BLOCK))  # three full blocks


@dataclass
class FakeReplica:
    replica_id: ReplicaID
    replica_metadata: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 100

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _pending(token_ids: list[int]) -> PendingRequest:
    request = PreparedRequest("r", None, token_ids, SamplingParams(max_tokens=1), None)
    return PendingRequest(
        args=[[request]], kwargs={}, metadata=RequestMetadata("r", "r"), future=None
    )


def _hashes(tokens: list[int]) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, BLOCK, None)
    return hashes


def _stored(tokens: list[int]) -> KVEventBatch:
    hashes = _hashes(tokens)
    return KVEventBatch(0.0, (BlockStored(tuple(hashes), None, tuple(tokens), BLOCK),))


class Harness:
    """The router on one event loop (Ray's router keeps the loop it first ran on)."""

    def __init__(self) -> None:
        self.router = KVAwareRouter(
            DEPLOYMENT, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
        )
        self.router.initialize_state(
            block_size=BLOCK, num_prefix_blocks=4, saturation_queue_len=SATURATION
        )
        self.runner = asyncio.Runner()

    def choose(self, replicas: list[Any], tokens: list[int]) -> str:
        """The replica id the router ranks first for a prompt of ``tokens``."""
        ranks = self.runner.run(self.router.choose_replicas(replicas, _pending(tokens)))
        return str(ranks[0][0].replica_id.unique_id)

    def set_replicas(self, replicas: list[Any]) -> None:
        async def update() -> None:
            self.router.update_replicas(replicas)
            # Ray probes new replicas' queue lengths (0 here): let that land first.
            cache = self.router.replica_queue_len_cache
            async with asyncio.timeout(5):
                while any(cache.get(replica.replica_id) is None for replica in replicas):
                    await asyncio.sleep(0.01)

        self.runner.run(update())

    def close(self) -> None:
        self.runner.close()
        self.router.subscriber.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.close()


def _replicas(count: int) -> list[Any]:
    # Nothing listens there: ZMQ connects in the background and the test feeds the map.
    return [
        FakeReplica(
            ReplicaID(f"r{i}", DEPLOYMENT), {KV_EVENTS_ENDPOINT_KEY: f"tcp://127.0.0.1:{9 + i}"}
        )
        for i in range(count)
    ]


def test_the_longest_cached_prefix_wins_and_an_evicted_one_no_longer_does(harness: Harness) -> None:
    replicas = _replicas(2)
    harness.set_replicas(replicas)
    r0, r1 = (replica.replica_id for replica in replicas)
    harness.router.block_map.apply(r0, 0, _stored(PREFIX[: 2 * BLOCK]))
    harness.router.block_map.apply(r1, 0, _stored(PREFIX[:BLOCK]))
    for tail in range(4):
        assert harness.choose(replicas, [*PREFIX, 50 + tail]) == "r0"
    # r0 evicts its second block: r1's one block is now as long as r0's; both hold it,
    # so the load decides, in turn.
    harness.router.block_map.apply(r0, 1, KVEventBatch(0.0, (BlockRemoved((_hashes(PREFIX)[1],)),)))
    assert {harness.choose(replicas, [*PREFIX, 7]) for _ in range(4)} == {"r0", "r1"}
    harness.router.block_map.apply(r0, 2, KVEventBatch(0.0, (BlockRemoved((_hashes(PREFIX)[0],)),)))
    assert {harness.choose(replicas, [*PREFIX, 7]) for _ in range(4)} == {"r1"}


def test_no_match_and_a_saturated_holder_go_to_the_least_loaded(harness: Harness) -> None:
    replicas = _replicas(2)
    harness.set_replicas(replicas)
    r0, r1 = (replica.replica_id for replica in replicas)
    harness.router.replica_queue_len_cache.update(r0, 1)
    harness.router.replica_queue_len_cache.update(r1, 0)
    assert {harness.choose(replicas, [90 + i] * 2 * BLOCK) for i in range(4)} == {"r1"}
    assert harness.choose(replicas, [1, 2]) == "r1"  # no full block
    harness.router.block_map.apply(r0, 0, _stored(PREFIX))
    assert harness.choose(replicas, PREFIX) == "r0"
    harness.router.replica_queue_len_cache.update(r0, SATURATION)
    assert harness.choose(replicas, PREFIX) == "r1"


def test_a_removed_or_dead_replica_is_unsubscribed_and_forgotten(harness: Harness) -> None:
    replicas = _replicas(3)
    harness.set_replicas(replicas)
    ids = [replica.replica_id for replica in replicas]
    for replica_id in ids:
        harness.router.block_map.apply(replica_id, 0, _stored(PREFIX))
    harness.set_replicas(replicas[1:])
    length, holders = harness.router.block_map.longest_prefix(_hashes(PREFIX))
    assert (length, set(holders)) == (3, set(ids[1:]))
    harness.router.on_replica_actor_died(ids[1])
    assert harness.router.block_map.longest_prefix(_hashes(PREFIX)) == (3, ids[2:])


def test_a_replica_without_events_is_load_balanced_only(harness: Harness) -> None:
    silent = FakeReplica(ReplicaID("quiet", DEPLOYMENT))
    harness.set_replicas([silent])
    harness.router.block_map.apply(silent.replica_id, 0, _stored(PREFIX))  # not tracked: ignored
    assert harness.router.block_map.longest_prefix(_hashes(PREFIX)) == (0, [])
    assert harness.choose([silent], PREFIX) == "quiet"


def test_kv_aware_routing_needs_the_replicas_events() -> None:
    options = RayServeOptions(routing="kv-aware")
    with pytest.raises(InvalidParameterError, match="kv_events_endpoint"):
        build_application(EngineConfig.from_kwargs("some/model"), ServerConfig("m"), options)
    config = EngineConfig.from_kwargs("some/model", kv_events_endpoint="tcp://*:5557")
    assert build_application(config, ServerConfig("m"), options) is not None


def test_a_replica_names_a_wildcard_endpoint_by_its_nodes_address() -> None:
    import ray

    from kvserve.serve.ray.engine_replica import reachable_endpoint

    assert reachable_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    node = ray.util.get_node_ip_address()
    assert reachable_endpoint("tcp://0.0.0.0:5558") == f"tcp://{node}:5558"
