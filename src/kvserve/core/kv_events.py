"""KV cache events: what entered and left the prefix cache, step by step.

A router that sends requests to the replica most likely to hold their prefix
needs to know which blocks each replica has cached. The block pool reports
every change to a :class:`KVEventCollector`, and the engine hands the
events of one step out as a :class:`KVEventBatch` (in process, or published
over ZMQ by ``engine/kv_event_publisher.py``).

The event types follow vLLM's KV events field for field (docs/kv_events.md
gives the wire format), so routers written for vLLM can read kvserve's:

- :class:`BlockStored`: full blocks whose K/V became reusable, keyed by the
  chained hashes of ``block_hash.py``: consecutive blocks of one sequence,
  the first chained to ``parent_block_hash`` (None: the sequence's start).
- :class:`BlockRemoved`: cached blocks evicted to hold new content.
- :class:`AllBlocksCleared`: the whole prefix cache was dropped.

Plain dataclasses with no dependency: the optional ``kv-events`` extra
(msgspec, pyzmq) is needed only to publish them. With events off the pool
holds no collector and builds no event objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the prefix cache.

    block_hashes: the blocks' chained hashes, in sequence order.
    parent_block_hash: the hash of the block just before the first one, or
        None when the first is the sequence's first block.
    token_ids: the blocks' tokens, ``block_size`` per block, concatenated.
    block_size: tokens per block.
    lora_id: always None (kvserve has no LoRA adapters); kept for vLLM's shape.
    medium: where the K/V live: ``"CPU"`` or ``"GPU"``.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted: their hashes no longer find anything."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block was forgotten (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, in the order they happened.

    ts: wall-clock time (``time.time()``, seconds) when the batch was taken.
    """

    ts: float
    events: tuple[KVCacheEvent, ...]


class KVEventCollector:
    """Gathers the block pool's events until the engine takes them (once per step).

    medium: stamped on every event, ``"CPU"`` or ``"GPU"``.
    """

    def __init__(self, medium: str = "CPU") -> None:
        self.medium = medium
        self._events: list[KVCacheEvent] = []

    def __len__(self) -> int:
        return len(self._events)

    def block_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Record consecutive blocks entering the cache (``token_ids``: all their tokens)."""
        if len(token_ids) != len(block_hashes) * block_size:
            raise AssertionError(
                f"{len(block_hashes)} blocks of {block_size} tokens, got {len(token_ids)} tokens"
            )
        self._events.append(
            BlockStored(
                tuple(block_hashes),
                parent_block_hash,
                tuple(token_ids),
                block_size,
                medium=self.medium,
            )
        )

    def block_removed(self, block_hashes: Sequence[BlockHash]) -> None:
        """Record cached blocks evicted from the cache."""
        self._events.append(BlockRemoved(tuple(block_hashes), medium=self.medium))

    def all_blocks_cleared(self) -> None:
        """Record that the whole cache was dropped."""
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last take, oldest first; the collector is emptied."""
        events, self._events = self._events, []
        return events
