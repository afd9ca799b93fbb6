"""Which cached blocks each replica holds, as its KV cache events tell.

The KV-aware router (``kv_aware_router.py``) keeps one :class:`ReplicaBlockMap`.
Each replica's published batches (``engine/kv_event_publisher.py``: a sequence
number from 0, then the batch) are applied in order: ``BlockStored`` adds its
hashes to the replica's set, ``BlockRemoved`` deletes them, ``AllBlocksCleared``
empties it. A batch whose sequence number is not the next one means messages
were lost, so the set may name blocks the replica has evicted: it is emptied
and refills from the following events. A map that misses blocks only costs a
cache miss; one that names evicted blocks would send requests to the wrong
replica. The first batch a subscriber gets may have any number (it joined
late); its set starts from it, missing what was stored before.

Thread safety: the subscriber thread applies batches while the router reads;
every method takes the map's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

from kvserve.core.block_hash import BlockHash
from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class ReplicaBlockMap:
    """Per replica (any hashable key), the block hashes its events say it caches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[Hashable, set[BlockHash]] = {}
        self._next_seq: dict[Hashable, int] = {}
        self.num_gaps = 0

    def add_replica(self, replica: Hashable) -> None:
        """Start tracking ``replica`` with nothing cached (no-op if tracked)."""
        with self._lock:
            self._blocks.setdefault(replica, set())

    def drop_replica(self, replica: Hashable) -> None:
        """Forget ``replica`` and everything it held."""
        with self._lock:
            self._blocks.pop(replica, None)
            self._next_seq.pop(replica, None)

    def reset(self, replica: Hashable) -> None:
        """Empty ``replica``'s set and restart its numbering (a batch could not be read)."""
        with self._lock:
            if replica in self._blocks:
                self._blocks[replica] = set()
                self._next_seq.pop(replica, None)

    def apply(self, replica: Hashable, seq: int, batch: KVEventBatch) -> None:
        """Apply ``replica``'s batch number ``seq``; a gap before it empties the set first.

        A batch for a replica not tracked (dropped meanwhile) is ignored.
        """
        with self._lock:
            blocks = self._blocks.get(replica)
            if blocks is None:
                return
            expected = self._next_seq.get(replica)
            if expected is not None and seq != expected:
                # Lost batches: some removals may be among them.
                self.num_gaps += 1
                blocks.clear()
            self._next_seq[replica] = seq + 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    blocks.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> tuple[int, list[Hashable]]:
        """How many leading blocks of ``hashes`` the best replicas hold, and those replicas.

        ``hashes`` are a prompt's chained block hashes: a replica holds a prefix
        of k blocks when it holds the first k (a chained hash names its whole
        prefix, so the k-th alone would do; checking each tolerates a set
        that lost a parent in a gap). (0, []) when no replica holds the first.
        """
        with self._lock:
            best, holders = 0, []
            for replica, blocks in self._blocks.items():
                length = 0
                while length < len(hashes) and hashes[length] in blocks:
                    length += 1
                if length > best:
                    best, holders = length, [replica]
                elif length == best and length > 0:
                    holders.append(replica)
            return best, holders
