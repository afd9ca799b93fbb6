"""KV cache groups: layers that share one block table per request.

A model whose attention layers all see the whole history (Llama) has one
group of every layer, and a block id stands for ``block_size`` tokens' K/V in
all of them. Models like Gemma 2 and 3 interleave sliding-window layers (a
query sees only the last ``sliding_window`` positions) with global ones. A
sliding layer never again reads a block that lies wholly before the window of
the next token to compute, so its blocks can go back to the pool as the
sequence grows; a global layer keeps every block.

To make that saving real, layers are partitioned into groups of equal size
``G``: the smallest number of layers of any attention type (a type is one
``sliding_window`` value; None = global). Each type's layers, in model order,
fill groups of ``G`` (a type whose count is not a multiple of ``G`` ends with
a smaller group). The pool then holds ``G`` layer tensors, and layer ``j`` of
every group reads and writes tensor ``j``: a block id covers ``G`` layers'
worth of bytes, and at any moment it belongs to one group of one request (or
to none). Gemma 3 270M, 15 sliding and 3 global layers: ``G = 3``, five
sliding groups and one global group, and the pool is 3 layers deep instead
of 18.

:class:`GroupBlockTables` keeps one group's per-request block tables over
the shared :class:`BlockPool`. A table keeps positional indexing (entry ``j``
covers positions ``j * block_size .. (j + 1) * block_size - 1``); entries a
sliding group has given back hold the null block, which the attention
backends never give weight to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group.

    layer_indices: positions of the group's layers among the model's attention
        layers (in module order); the group's j-th layer uses pool tensor j.
    sliding_window: the layers' window (a query at position p sees keys
        ``p - sliding_window < k <= p``), or None for global attention.
    """

    layer_indices: tuple[int, ...]
    sliding_window: int | None = None


def make_kv_cache_groups(sliding_windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """Partition attention layers, given each one's window, into groups of equal size.

    Types appear in the order of their first layer; each type's layers fill
    groups of ``G`` (the smallest count of any type) in model order. One
    attention type gives one group of every layer.
    """
    if not sliding_windows:
        raise ValueError("a model needs at least one attention layer")
    for window in sliding_windows:
        if window is not None and (isinstance(window, bool) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {window!r}")
    layers_by_type: dict[int | None, list[int]] = {}
    for index, window in enumerate(sliding_windows):
        layers_by_type.setdefault(window, []).append(index)
    group_size = min(len(layers) for layers in layers_by_type.values())
    return tuple(
        KVCacheGroupSpec(tuple(layers[start : start + group_size]), window)
        for window, layers in layers_by_type.items()
        for start in range(0, len(layers), group_size)
    )


def num_pool_layers(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Layer tensors the pool holds: the largest group's size (``G``)."""
    return max(len(group.layer_indices) for group in groups)


def group_blocks_for_sequence(
    sliding_window: int | None, num_tokens: int, block_size: int, max_chunk_tokens: int
) -> int:
    """The most blocks one group holds for a sequence of ``num_tokens`` tokens.

    The sequence is computed in steps of at most ``max_chunk_tokens`` tokens.
    While a sliding group computes a chunk it holds the ``window - 1`` keys
    before the chunk and the chunk itself; that span can straddle one more
    block boundary than its length needs.
    """
    num_full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return num_full
    span = sliding_window - 1 + min(max_chunk_tokens, num_tokens)
    return min(num_full, cdiv(span, block_size) + 1)


def blocks_for_sequence(
    sliding_windows: Sequence[int | None],
    num_tokens: int,
    block_size: int,
    max_chunk_tokens: int | None = None,
) -> int:
    """The most blocks, over all groups (given by window), one sequence holds at once.

    max_chunk_tokens: the largest chunk a step computes for it; None means the
    whole sequence may come in one step.
    """
    chunk = num_tokens if max_chunk_tokens is None else max_chunk_tokens
    return sum(
        group_blocks_for_sequence(window, num_tokens, block_size, chunk)
        for window in sliding_windows
    )


class GroupBlockTables:
    """One group's block table per request, over a pool shared with the other groups.

    free_out_of_window: give back blocks a sliding group will not read again;
    False keeps every group's whole history (for comparisons and tests).
    """

    def __init__(
        self,
        sliding_window: int | None,
        block_size: int,
        block_pool: BlockPool,
        free_out_of_window: bool = True,
    ) -> None:
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.block_pool = block_pool
        self.frees_blocks = sliding_window is not None and free_out_of_window
        self.tables: dict[str, list[KVBlock]] = {}
        # Per request: leading table entries already given back (now the null block).
        self._num_released: dict[str, int] = {}

    def holds(self, request_id: str) -> bool:
        return request_id in self.tables

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table in position order; given-back entries are ``NULL_BLOCK_ID``."""
        return [block.block_id for block in self.tables.get(request_id, ())]

    def num_held(self, request_id: str) -> int:
        """Blocks the request holds in this group (null entries excluded)."""
        return len(self.tables.get(request_id, ())) - self._num_released.get(request_id, 0)

    def _num_unreachable(self, num_computed_tokens: int) -> int:
        """Leading blocks no token from position ``num_computed_tokens`` on will read.

        The first query still to come sits at ``num_computed_tokens`` and sees
        keys from ``num_computed_tokens - window + 1``; blocks wholly before
        that position are done with.
        """
        if not self.frees_blocks:
            return 0
        assert self.sliding_window is not None
        first_visible = num_computed_tokens - self.sliding_window + 1
        return max(first_visible, 0) // self.block_size

    def num_releasable(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks :meth:`release_unreachable` would give back now."""
        if not self.frees_blocks:
            return 0
        table = self.tables.get(request_id)
        if table is None:
            return 0
        end = min(self._num_unreachable(num_computed_tokens), len(table))
        return max(end - self._num_released.get(request_id, 0), 0)

    def release_unreachable(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the window; their entries become the null block."""
        num_releasable = self.num_releasable(request_id, num_computed_tokens)
        if num_releasable == 0:
            return
        table = self.tables[request_id]
        start = self._num_released.get(request_id, 0)
        end = start + num_releasable
        self.block_pool.free_blocks(table[start:end])
        table[start:end] = [self.block_pool.null_block] * num_releasable
        self._num_released[request_id] = end

    def covers(self, request_id: str, num_tokens: int) -> bool:
        """Does the request's table (open) reach ``num_tokens`` positions, and will none of
        its blocks be given back (no sliding window here)? Then a step of that many
        tokens changes nothing in this group."""
        table = self.tables.get(request_id)
        return (
            table is not None
            and not self.frees_blocks
            and len(table) * self.block_size >= num_tokens
        )

    def num_missing(self, request_id: str, num_tokens: int, num_hit_blocks: int = 0) -> int:
        """New blocks the table needs to cover ``num_tokens`` positions (after a hit's blocks)."""
        num_present = len(self.tables.get(request_id, ())) + num_hit_blocks
        return max(cdiv(num_tokens, self.block_size) - num_present, 0)

    def start(self, request_id: str, hit_blocks: Sequence[KVBlock] = ()) -> None:
        """Open the request's table, beginning with a prefix-cache hit's blocks if any."""
        self.block_pool.touch(hit_blocks)
        self.tables[request_id] = list(hit_blocks)

    def extend(self, request_id: str, num_tokens: int) -> list[int]:
        """Take blocks from the pool until the table covers ``num_tokens`` positions.

        Returns the new blocks' ids. The caller has checked that enough are free.
        """
        num_missing = self.num_missing(request_id, num_tokens)
        if num_missing == 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_missing)
        self.tables[request_id].extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` positions, the last one first.

        For speculative decoding: blocks taken for proposals that were rejected
        hold no token the request keeps (and were never cached).
        """
        table = self.tables.get(request_id)
        if table is None:
            return
        num_kept = max(cdiv(num_tokens, self.block_size), self._num_released.get(request_id, 0))
        if len(table) > num_kept:
            self.block_pool.free_blocks(reversed(table[num_kept:]))
            del table[num_kept:]

    def free(self, request_id: str) -> None:
        """Give back every block the request holds in this group, its last block first."""
        table = self.tables.pop(request_id, [])
        num_released = self._num_released.pop(request_id, 0)
        self.block_pool.free_blocks(reversed(table[num_released:]))
