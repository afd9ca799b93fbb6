"""The KV-aware request router: requests go where the replicas' caches hold their prefix.

Where ``PrefixAwareRouter`` (``router.py``) remembers where it sent each
prefix, this router reads what the replicas actually cache: every replica
publishes its KV cache events (``engine/kv_event_publisher.py``) and tells its
endpoint in its Ray Serve replica metadata (``record_replica_metadata``, key
:data:`KV_EVENTS_ENDPOINT_KEY`); the router subscribes to each replica Ray
reports running (``kv_event_subscriber.py``) and keeps each one's cached block
hashes (``replica_block_map.py``). A replica Ray stops reporting, or reports
dead, is unsubscribed and its blocks forgotten.

A request's key is the chain of hashes of its first ``num_prefix_blocks`` full
prompt blocks, as the prefix router computes it (the replicas' hashes exactly).
It goes to the replica holding the longest prefix of that chain; among several,
the least loaded; with none, or when the chosen one has
``saturation_queue_len`` calls in flight, the least loaded replica, ties taken
in turn (the prefix router's load rule).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import ReplicaID, RunningReplica

from kvserve.core.block_hash import BlockHash
from kvserve.serve.ray.kv_event_subscriber import KVEventSubscriber
from kvserve.serve.ray.replica_block_map import ReplicaBlockMap
from kvserve.serve.ray.router import PrefixKeyedRouter

logger = logging.getLogger(__name__)

# The replica metadata key under which a replica names its KV events endpoint.
KV_EVENTS_ENDPOINT_KEY = "kv_events_endpoint"


class KVAwareRouter(PrefixKeyedRouter):
    """Requests to the replica whose KV cache events say it holds their longest prefix.

    Router kwargs (``RequestRouterConfig.request_router_kwargs``): ``block_size``,
    ``num_prefix_blocks`` and ``saturation_queue_len`` as ``PrefixAwareRouter``'s;
    kv_events_topic: the topic the replicas publish under.
    """

    def initialize_state(
        self,
        block_size: int = 16,
        num_prefix_blocks: int = 8,
        saturation_queue_len: int = 16,
        kv_events_topic: str = "",
        **kwargs: Any,
    ) -> None:
        self.setup_prefix_keys(block_size, num_prefix_blocks, saturation_queue_len)
        self.block_map = ReplicaBlockMap()
        self.subscriber = KVEventSubscriber(self.block_map, kv_events_topic)
        self._watched: set[ReplicaID] = set()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {replica.replica_id: replica for replica in replicas}
        for replica_id in self._watched - set(current):
            self._unwatch(replica_id)
        for replica_id in set(current) - self._watched:
            endpoint = current[replica_id].replica_metadata.get(KV_EVENTS_ENDPOINT_KEY)
            if endpoint is None:
                # It publishes nothing: it is never preferred, only load-balanced.
                logger.warning("replica %s publishes no KV cache events", replica_id)
                continue
            self.subscriber.watch(replica_id, endpoint)
            self._watched.add(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._unwatch(replica_id)

    def _unwatch(self, replica_id: ReplicaID) -> None:
        if replica_id in self._watched:
            self._watched.discard(replica_id)
            self.subscriber.unwatch(replica_id)

    def preferred(
        self, by_load: list[RunningReplica], hashes: list[BlockHash]
    ) -> RunningReplica | None:
        _, holders = self.block_map.longest_prefix(hashes)
        # by_load is least loaded first: the first holder in it breaks a tie by load.
        return next((r for r in by_load if r.replica_id in holders), None)
