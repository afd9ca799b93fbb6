"""Fixed-size KV blocks: reference counts, the free queue and the prefix cache.

Block 0 is the null block. It is never handed out; block tables are padded
with it, so the attention kernels can gather a rectangle of blocks without a
branch for "no block here".

Free blocks are handed out in this order:

1. blocks written before that hold nothing worth keeping (no hash: a
   request's partial last block, every block with prefix caching off, the
   blocks a cache reset forgot), the most recently freed first;
2. blocks never written since the pool was made, lowest id first;
3. cached blocks, least recently freed first: with prefix caching a freed
   block keeps its contents and its hash, so this part is the eviction order,
   and a block loses its hash only when it is reused for new content.

The pool is an anonymous mapping the kernel backs page by page as it is
first written (``worker/kv_pool.py``), so taking written blocks before
never-written ones keeps the server's resident memory at what its load has
needed at once, instead of growing through the whole pool; cached blocks
still wait behind the never-written ones, so caching loses nothing. A cache
hit on a free block takes it out of the queue.

With KV cache events on (``events``, see ``kv_events.py``) the pool reports
each block entering the cache, each cached block evicted, and each reset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvserve.core.block_hash import BlockHash
from kvserve.core.kv_events import KVEventCollector

NULL_BLOCK_ID = 0


class KVBlock:
    """One block of ``block_size`` token slots in every layer's K and V cache.

    block_hash, token_ids: set while the block is in the prefix cache (its
    K/V are final and reusable); both None otherwise.
    """

    __slots__ = ("block_hash", "block_id", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    """Owns every block; hands free ones out, takes them back, remembers cached ones.

    Invariants: a block is in the free queue exactly when its ``ref_cnt`` is 0
    and it is not the null block; a block has a ``block_hash`` exactly when the
    hash map points to it.

    events: where evictions and resets are reported; None (the default)
    reports nothing and builds no event objects. Blocks entering the cache
    are reported by the :class:`KVCacheManager`, which knows their order.
    """

    def __init__(self, num_blocks: int, events: KVEventCollector | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # Free blocks without a hash that were written before, most recently freed last.
        self._reusable: dict[int, None] = {}
        # Never-written blocks, then cached ones in eviction order (never-written
        # blocks are never put back, so they stay in front); an OrderedDict gives
        # O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self.events = events

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold data: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included: they are evicted on demand."""
        return len(self._reusable) + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, whether held by a request or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        """Every free block in the order they are handed out, next to be reused first."""
        return [*reversed(self._reusable), *self._free]

    def cached_free_block_ids(self) -> list[int]:
        """Free blocks that still hold a cached prefix, in no particular order.

        Read-only, O(cached blocks): for views of the pool such as the dashboard.
        """
        return [block.block_id for block in self._cached.values() if block.ref_cnt == 0]

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take the next ``num_blocks`` free blocks (see the module docstring), each with
        ref_cnt 1.

        A cached block taken here is evicted: its old contents are about to
        be overwritten.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        blocks = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            if self._reusable:
                block_id, _ = self._reusable.popitem()
            else:
                block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
                block.token_ids = None
            block.ref_cnt = 1
            blocks.append(block)
        if evicted and self.events is not None:
            self.events.block_removed(evicted)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (cache hits); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    del self._reusable[block.block_id]
                else:
                    del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; a block nobody holds is free again.

        A cached block goes to the back of the eviction order and keeps its
        hash there until reused; one without a hash is the next to be handed
        out. Pass a request's blocks tail first: its last cached blocks are
        then evicted first, which keeps shared prefixes around longest.
        """
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise AssertionError(f"freeing {block}, which is not held")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._reusable[block.block_id] = None
                else:
                    self._free[block.block_id] = None

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block with this hash, if its stored tokens are ``token_ids`` too.

        The token check guards against a hash collision handing out another
        prefix's K/V; with SHA-256 it should never fail.
        """
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Enter a held block whose K/V are now final into the prefix cache.

        If another block already holds this prefix (two requests computed it
        in the same step), that one stays the cached copy and ``block`` stays
        private, to be reused like any uncached block once freed. Returns
        whether ``block`` entered the cache.
        """
        if block.ref_cnt <= 0 or block is self.null_block:
            raise AssertionError(f"caching {block}, which is not held")
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def add_cached_blocks(
        self, entries: Sequence[tuple[BlockHash, Sequence[int]]]
    ) -> list[KVBlock]:
        """Take free blocks for prefixes found elsewhere (the disk tier) and cache them.

        The blocks come back held (ref_cnt 1) for the caller to fill with the
        entries' K/V and then free. Entries whose hash is cached already are
        skipped (the result is shorter), and so are those past the free blocks.
        """
        wanted = [(h, t) for h, t in entries if h not in self._cached]
        blocks = self.get_new_blocks(min(len(wanted), self.num_free_blocks))
        for block, (block_hash, token_ids) in zip(blocks, wanted, strict=False):
            self.cache_block(block, block_hash, token_ids)
        return blocks

    def cached_block_hashes(self) -> set[BlockHash]:
        """The hashes the prefix cache holds now (a copy; for checks and views)."""
        return set(self._cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks start cold); False while any block is held.

        Held blocks are refused because the requests holding them count
        their leading blocks as cached and would never cache them again.
        """
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        # The forgotten blocks were written: they are handed out after the reusable
        # ones already free and before never-written ones, in their old eviction order
        # (``_reusable`` hands out its last entry first).
        forgotten = [i for i in self._free if self.blocks[i].block_hash is not None]
        for block_id in forgotten:
            del self._free[block_id]
            self.blocks[block_id].block_hash = None
            self.blocks[block_id].token_ids = None
        self._reusable = {**dict.fromkeys(reversed(forgotten)), **self._reusable}
        self._cached.clear()
        if self.events is not None:
            self.events.all_blocks_cleared()
        return True
