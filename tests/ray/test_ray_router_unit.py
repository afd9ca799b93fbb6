"""The prefix-aware router's choices, without a cluster: fake replicas, real Ray router code."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from kvserve.engine.async_commands import PreparedRequest
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams
from kvserve.serve.ray.app import app_builder
from kvserve.serve.ray.router import PrefixAwareRouter, prompt_block_hashes

DEPLOYMENT = DeploymentID(name="KVServeEngine", app_name="kvserve")
BLOCK_SIZE = 4
SATURATION = 3


@dataclass
class FakeReplica:
    replica_id: ReplicaID
    max_ongoing_requests: int = 100


def _pending(token_ids: list[int], salt: str | None = None) -> PendingRequest:
    request = PreparedRequest("r", None, token_ids, SamplingParams(max_tokens=1), salt)
    # The router never touches the future (Ray's routing loop does): none is needed here.
    metadata = RequestMetadata("r", "r")
    return PendingRequest(args=[[request]], kwargs={}, metadata=metadata, future=None)


def _router() -> tuple[PrefixAwareRouter, list[Any]]:
    router = PrefixAwareRouter(
        DEPLOYMENT, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
    )
    router.initialize_state(
        block_size=BLOCK_SIZE, num_prefix_blocks=4, saturation_queue_len=SATURATION
    )
    replicas = [FakeReplica(ReplicaID(name, DEPLOYMENT)) for name in ("r0", "r1")]
    return router, replicas


async def _choose(router: PrefixAwareRouter, replicas: list[Any], pending: Any) -> Any:
    return await router.choose_replicas(replicas, pending)


def _route(router: PrefixAwareRouter, replicas: list[Any], token_ids: list[int]) -> str:
    """Choose, then record the choice as Ray does; the chosen replica's id."""

    async def route() -> str:
        pending = _pending(token_ids)
        chosen = (await _choose(router, replicas, pending))[0][0]
        router.on_request_routed(pending, chosen.replica_id, None)
        return str(chosen.replica_id.unique_id)

    return asyncio.run(route())


def test_a_shared_prefix_follows_its_replica_until_it_is_saturated() -> None:
    router, replicas = _router()
    prefix = list(range(10, 10 + 3 * BLOCK_SIZE))
    owner = _route(router, replicas, [*prefix, 1, 2, 3, 4])
    for tail in range(5):
        assert _route(router, replicas, [*prefix, 50 + tail, 1, 2, 3]) == owner
    owner_id = next(r.replica_id for r in replicas if r.replica_id.unique_id == owner)
    router.replica_queue_len_cache.update(owner_id, SATURATION)
    assert _route(router, replicas, [*prefix, 9, 9, 9, 9]) != owner


def test_fresh_prompts_take_turns_and_short_ones_are_routed_too() -> None:
    router, replicas = _router()
    chosen = [_route(router, replicas, [100 + i] * 2 * BLOCK_SIZE) for i in range(6)]
    assert chosen.count("r0") == chosen.count("r1") == 3
    assert _route(router, replicas, [1, 2]) in {"r0", "r1"}  # no full block: least loaded


def test_the_cache_salt_keys_the_route_as_it_keys_the_cache() -> None:
    tokens = list(range(2 * BLOCK_SIZE))
    plain = prompt_block_hashes(_pending(tokens), BLOCK_SIZE, 4)
    salted = prompt_block_hashes(_pending(tokens, "tenant"), BLOCK_SIZE, 4)
    assert len(plain) == len(salted) == 2 and not set(plain) & set(salted)


def test_a_dead_replica_is_forgotten() -> None:
    router, replicas = _router()
    prefix = list(range(3 * BLOCK_SIZE))
    owner = _route(router, replicas, prefix)
    dead = next(r for r in replicas if r.replica_id.unique_id == owner)
    router.on_replica_actor_died(dead.replica_id)
    survivor = [r for r in replicas if r is not dead]
    assert asyncio.run(_choose(router, survivor, _pending(prefix))) == [survivor]


def test_router_settings_are_checked() -> None:
    router, _ = _router()
    with pytest.raises(ValueError, match="saturation_queue_len"):
        router.initialize_state(saturation_queue_len=0)


def test_app_builder_takes_the_cli_settings_and_refuses_unknown_keys() -> None:
    app = app_builder(
        {
            "model": "some/model",
            "replicas": 3,
            "routing": "round-robin",
            "engine": {"block_size": 8},
        }
    )
    assert app is not None
    with pytest.raises(InvalidParameterError, match="replica_count"):
        app_builder({"model": "some/model", "replica_count": 3})
    with pytest.raises(InvalidParameterError, match="routing"):
        app_builder({"model": "some/model", "routing": "random"})
