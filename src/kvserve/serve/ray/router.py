"""Request routers for the engine deployment: prefix-aware, and round robin as the baseline.

Both run inside the caller of the engine's DeploymentHandle (the ingress
replica), so their state is local to each ingress replica and rebuilt from
traffic after a restart. The pending request's first argument is the list of
``PreparedRequest`` the ingress built; the router reads its token ids.

Prefix-aware: the key of a request is the chain of hashes of its first
``num_prefix_blocks`` full prompt blocks (``core/block_hash.py``, the replicas'
block size and the request's cache salt, so a key names the very blocks a
replica's prefix cache holds). The router remembers which replica each block
hash went to last; a request goes to the replica of its longest remembered
prefix, unless that replica has ``saturation_queue_len`` requests or more in
flight, in which case (and when nothing matches) it goes to the least loaded
replica, ties broken in turn.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.core.block_hash import BlockHash, extend_block_hashes

# Block hashes remembered per ingress replica (32-byte keys: ~10 MiB at most).
DEFAULT_MAX_REMEMBERED_BLOCKS = 100_000


def prompt_block_hashes(
    pending_request: PendingRequest | None, block_size: int, num_blocks: int
) -> list[BlockHash]:
    """The chained hashes of the first ``num_blocks`` full prompt blocks of the request's
    first prompt; empty when the request carries no token ids."""
    if pending_request is None or not pending_request.args:
        return []
    requests = pending_request.args[0]
    if not isinstance(requests, list) or not requests:
        return []
    first = requests[0]
    token_ids = getattr(first, "prompt_token_ids", None)
    if not token_ids:
        return []
    hashes: list[BlockHash] = []
    head = token_ids[: block_size * num_blocks]
    extend_block_hashes(hashes, head, block_size, getattr(first, "cache_salt", None))
    return hashes


def check_router_settings(**settings: object) -> None:
    """ValueError naming the first setting that is not a positive integer."""
    for name, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def ranks_preferring(
    router: RequestRouter,
    by_load: list[RunningReplica],
    preferred: RunningReplica | None,
    saturation_queue_len: int,
) -> list[list[RunningReplica]]:
    """Ray's ranks: ``preferred`` first unless it has ``saturation_queue_len`` calls in
    flight, then the rest by load. One replica per rank: Ray takes the first rank
    whose replica accepts."""
    if preferred is not None and _queue_len(router, preferred) < saturation_queue_len:
        by_load = [preferred, *(replica for replica in by_load if replica is not preferred)]
    return [[replica] for replica in by_load]


class TurnTaking:
    """Orders replicas by load, ties broken in turn so idle replicas share the work."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def by_load(
        self, router: RequestRouter, replicas: list[RunningReplica]
    ) -> list[RunningReplica]:
        if not replicas:
            return []
        start = next(self._turn) % len(replicas)
        rotated = replicas[start:] + replicas[:start]
        return sorted(rotated, key=lambda replica: _queue_len(router, replica))


def _queue_len(router: RequestRouter, replica: RunningReplica) -> int:
    """Requests the router believes are in flight on ``replica`` (0 when it does not know)."""
    return router.replica_queue_len_cache.get(replica.replica_id) or 0


class PrefixKeyedRouter(RequestRouter):
    """What the prefix- and kv-aware routers share: a request's key (the chained hashes
    of its first ``num_prefix_blocks`` full prompt blocks) and the load rule around the
    replica a subclass prefers for that key (:meth:`preferred`)."""

    def setup_prefix_keys(
        self, block_size: int, num_prefix_blocks: int, saturation_queue_len: int, **more: int
    ) -> None:
        """Check and keep the key's and the load rule's settings (``more``: a subclass's)."""
        check_router_settings(
            block_size=block_size,
            num_prefix_blocks=num_prefix_blocks,
            saturation_queue_len=saturation_queue_len,
            **more,
        )
        self._block_size = block_size
        self._num_prefix_blocks = num_prefix_blocks
        self._saturation_queue_len = saturation_queue_len
        self._turns = TurnTaking()

    def _hashes(self, pending_request: PendingRequest | None) -> list[BlockHash]:
        return prompt_block_hashes(pending_request, self._block_size, self._num_prefix_blocks)

    def preferred(
        self, by_load: list[RunningReplica], hashes: list[BlockHash]
    ) -> RunningReplica | None:
        """The replica of ``by_load`` (least loaded first) that should serve ``hashes``."""
        raise NotImplementedError

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_load = self._turns.by_load(self, list(candidate_replicas))
        preferred = self.preferred(by_load, self._hashes(pending_request))
        return ranks_preferring(self, by_load, preferred, self._saturation_queue_len)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (among the least loaded, so a busy one is skipped)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._next = itertools.count()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        start = next(self._next) % len(ordered)
        return [[replica] for replica in ordered[start:] + ordered[:start]]


class PrefixAwareRouter(PrefixKeyedRouter):
    """Requests sharing a prompt prefix go to the replica that computed it last.

    Router kwargs (``RequestRouterConfig.request_router_kwargs``):
    block_size: the replicas' KV block size (tokens).
    num_prefix_blocks: how many leading prompt blocks make a request's key.
    saturation_queue_len: a preferred replica with this many requests in flight
        is passed over for the least loaded one.
    max_remembered_blocks: block hashes remembered, least recently used dropped first.
    """

    def initialize_state(
        self,
        block_size: int = 16,
        num_prefix_blocks: int = 8,
        saturation_queue_len: int = 16,
        max_remembered_blocks: int = DEFAULT_MAX_REMEMBERED_BLOCKS,
        **kwargs: Any,
    ) -> None:
        self.setup_prefix_keys(
            block_size,
            num_prefix_blocks,
            saturation_queue_len,
            max_remembered_blocks=max_remembered_blocks,
        )
        self._max_remembered = max_remembered_blocks
        self._owner: OrderedDict[BlockHash, ReplicaID] = OrderedDict()

    def preferred(
        self, by_load: list[RunningReplica], hashes: list[BlockHash]
    ) -> RunningReplica | None:
        # The longest remembered prefix: its replica holds the most of this prompt.
        owner = next((self._owner[h] for h in reversed(hashes) if h in self._owner), None)
        return next((r for r in by_load if r.replica_id == owner), None)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        for block_hash in self._hashes(pending_request):
            self._owner[block_hash] = replica_id
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self._max_remembered:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        stale = [block_hash for block_hash, owner in self._owner.items() if owner == replica_id]
        for block_hash in stale:
            del self._owner[block_hash]
