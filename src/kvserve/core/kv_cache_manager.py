"""The scheduler's only view of KV memory.

It maps each request to the blocks that hold its K/V (its block table) and
grows or frees that table. It never touches tensors: slots are numbers, and
``worker/`` turns them into a ``slot_mapping`` at the device boundary.

With prefix caching on, it also finds the longest cached prefix of a request
about to be admitted (:meth:`get_computed_blocks`) and enters the request's
blocks into the cache once they are full of computed tokens
(:meth:`cache_blocks`). A request only ever writes K/V at positions past its
computed tokens, and only whole, computed blocks are cached or shared, so a
shared block is never written.

Each KV cache group (see ``kv_cache_groups.py``) has its own table per
request over the one shared pool; a model with one attention type has one
group, and everything reads as a single table. Sliding-window groups give
back the blocks that fall wholly before the window of every token still to
compute: before they allocate for a step, and after each step
(:meth:`release_unreachable_blocks`). Prefix caching needs a single group of
global attention: keeping it correct for windows is not implemented, so the
engine turns it off for models with sliding-window layers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from kvserve.core.block_hash import BlockHash, extend_block_hashes
from kvserve.core.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from kvserve.core.disk_store import DiskBlockStore
from kvserve.core.kv_cache_groups import GroupBlockTables, blocks_for_sequence, cdiv
from kvserve.core.kv_events import KVEventCollector
from kvserve.core.request import Request

__all__ = ["NO_HIT", "ComputedBlocks", "DiskRun", "KVCacheManager", "StoredBlock", "cdiv"]

# How many hashes the manager remembers having handed to the disk tier: enough to
# cover the blocks in its write queue, so that a prompt block shared by requests of
# the same steps is copied out once, not once per request (a few hundred KiB).
_OFFERED_TO_DISK_RECORD = 4096


class DiskRun(NamedTuple):
    """Blocks of a request's prefix that the disk tier holds, just past the pool's hit.

    hashes, token_ids: per block to read back, in position order; a run may
    skip blocks the pool holds itself.
    """

    hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]
    parent_hashes: list[BlockHash | None]


class StoredBlock(NamedTuple):
    """A full block of a request's prompt, computed or hit, for the disk tier to write."""

    block_id: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]


class LoadedBlocks(NamedTuple):
    """Blocks taken for a run read from disk (``filled``, to be copied into), and
    with them the request's prefix blocks the pool holds already, all held until
    released (``chain``: every one of them in position order)."""

    chain: list[KVBlock]
    filled: list[KVBlock]


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: blocks holding a request's first ``num_tokens`` tokens.

    next_block_hash: the hash of the first block after the hit, when the hit
    could have been longer (the scheduler defers a request whose next block
    another request is computing right now).
    """

    blocks: list[KVBlock]
    num_tokens: int
    next_block_hash: BlockHash | None


NO_HIT = ComputedBlocks([], 0, None)


class KVCacheManager:
    """Per-request, per-group block tables over a shared :class:`BlockPool`.

    enable_caching: look up and fill the prefix cache. The engine passes what
        ``CacheConfig.prefix_caching_for`` resolves (on by default for models
        without sliding-window layers); a bare manager leaves it off.
    sliding_windows: one entry per KV cache group, in group order: the
        group's window, or None for global attention. The default is one
        global group (every model with a single attention type).
    free_out_of_window: give back blocks sliding groups no longer need; False
        keeps every group's whole history (comparisons and tests).
    kv_events: where the prefix cache's changes are reported (see
        ``kv_events.py``); None reports nothing.
    disk_store: the prefix cache's second tier on disk (see ``disk_store.py``),
        or None. With one, the full blocks of each request's prompt that the
        store lacks are kept for :meth:`take_stored_blocks` (the engine writes
        them behind the step; blocks of generated tokens are not written, see
        ``engine/disk_tier.py``), and :meth:`find_disk_run` looks past a pool hit.
    disk_write_generated: hand the disk tier the blocks that generated tokens
        fill as well (``prefix_cache_disk_write="all"``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        sliding_windows: Sequence[int | None] = (None,),
        free_out_of_window: bool = True,
        kv_events: KVEventCollector | None = None,
        disk_store: DiskBlockStore | None = None,
        disk_write_generated: bool = False,
    ) -> None:
        if not sliding_windows:
            raise ValueError("sliding_windows needs one entry per KV cache group, got none")
        if enable_caching and tuple(sliding_windows) != (None,):
            raise ValueError(
                "prefix caching needs a single group of global attention, "
                f"got groups with windows {tuple(sliding_windows)}"
            )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_windows = tuple(sliding_windows)
        # The windows that bound how many blocks a group holds (none while keeping history).
        self._bounding_windows = (
            self.sliding_windows if free_out_of_window else (None,) * len(self.sliding_windows)
        )
        self.block_pool = BlockPool(num_blocks, kv_events)
        self.kv_events = kv_events
        self.groups = tuple(
            GroupBlockTables(window, block_size, self.block_pool, free_out_of_window)
            for window in self.sliding_windows
        )
        # Per request: how many leading blocks of its table are in the cache already.
        self._num_cached_blocks: dict[str, int] = {}
        # Cumulative, in tokens, counted when a request is admitted.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        if disk_store is not None and not enable_caching:
            raise ValueError("the disk tier extends the prefix cache, which is off")
        self.disk_store = disk_store
        # Prompt blocks to write since the last take_stored_blocks (disk tier only).
        self._stored_for_disk: list[StoredBlock] = []
        self._disk_write_generated = disk_write_generated
        # Per request: how many of its leading blocks were considered for writing.
        self._num_disk_checked_blocks: dict[str, int] = {}
        # Hashes handed out to be written and not seen in the store since (queued, being
        # written, or written): not handed out again while remembered. Bounded, oldest
        # first; forgetting one early costs at most a second copy, which the store skips.
        self._offered_to_disk: OrderedDict[BlockHash, None] = OrderedDict()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.block_pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held, by any group of any request."""
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """The most blocks (all groups together) a sequence of ``num_tokens`` holds at once.

        max_chunk_tokens: the largest chunk a step computes of it (None: the
        whole sequence may come in one step); it matters for sliding groups only.
        """
        return blocks_for_sequence(
            self._bounding_windows, num_tokens, self.block_size, max_chunk_tokens
        )

    def can_ever_fit(self, num_tokens: int, max_chunk_tokens: int | None = None) -> bool:
        """Whether a sequence of ``num_tokens`` fits the whole pool, with nothing else in it."""
        return self.num_blocks_for(num_tokens, max_chunk_tokens) <= self.num_usable_blocks

    def num_blocks_to_grow(
        self, request: Request, num_tokens: int, max_chunk_tokens: int | None = None
    ) -> int:
        """The most blocks (all groups together) the request may still take before it is
        ``num_tokens`` long: its bound from :meth:`num_blocks_for` less what it holds now.

        Whatever the request does on the way (allocate, give back out-of-window
        blocks), its held blocks never pass that bound, so the blocks held plus
        this number never grow: the scheduler can reserve it.
        """
        bound = self.num_blocks_for(num_tokens, max_chunk_tokens)
        return max(bound - self.num_held_blocks(request.request_id), 0)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of each group (block ids in position order).

        Entries a sliding group gave back are ``NULL_BLOCK_ID``.
        """
        return tuple(group.block_ids(request_id) for group in self.groups)

    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request holds: each group's table in turn, null entries left out."""
        return [
            block_id
            for group in self.groups
            for block_id in group.block_ids(request_id)
            if block_id != NULL_BLOCK_ID
        ]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds, all groups together."""
        return sum(self.num_held_blocks_per_group(request_id))

    def num_held_blocks_per_group(self, request_id: str) -> tuple[int, ...]:
        """Blocks the request holds in each group (null entries excluded)."""
        return tuple(group.num_held(request_id) for group in self.groups)

    # ---------------------------------------------------------- prefix cache

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks of known tokens (computed or not)."""
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt
        )
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of a request that holds no blocks, in whole blocks.

        The hit stops short of the request's last token, so the step that
        computes the rest has logits to sample from; with a block-aligned
        sequence that leaves the whole last block to compute, in a block the
        request owns. Nothing changes until :meth:`allocate_slots` takes the hit.
        """
        if not self.enable_caching or self.groups[0].holds(request.request_id):
            return NO_HIT
        hashes = self.block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        tokens, size = request.all_token_ids, self.block_size
        blocks: list[KVBlock] = []
        for index in range(max_hit_blocks):
            block = self.block_pool.get_cached_block(
                hashes[index], tokens[index * size : (index + 1) * size]
            )
            if block is None:
                break
            blocks.append(block)
        next_hash = hashes[len(blocks)] if len(blocks) < max_hit_blocks else None
        return ComputedBlocks(blocks, len(blocks) * size, next_hash)

    def hashes_filled_by(self, request: Request, num_new_tokens: int) -> list[BlockHash]:
        """Hashes of the blocks that computing ``num_new_tokens`` more tokens fills."""
        if not self.enable_caching:
            return []
        first = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_new_tokens) // self.block_size
        return self.block_hashes(request)[first:end]

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's full blocks of computed tokens into the prefix cache.

        Called after each step that advanced ``num_computed_tokens``: only
        then are the blocks' K/V written. With a disk tier, also keeps the
        prompt's blocks that the disk lacks for :meth:`take_stored_blocks`.
        """
        blocks = self.groups[0].tables.get(request.request_id)
        if not self.enable_caching or blocks is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if self.disk_store is not None:
            self._offer_blocks_to_disk(request, blocks, num_full)
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        hashes = self.block_hashes(request)
        tokens, size = request.all_token_ids, self.block_size
        # Runs of consecutive blocks that entered the cache: one BlockStored each.
        runs: list[range] = []
        for index in range(num_cached, num_full):
            block_tokens = tokens[index * size : (index + 1) * size]
            stored = self.block_pool.cache_block(blocks[index], hashes[index], block_tokens)
            if stored and self.kv_events is not None:
                if runs and runs[-1].stop == index:
                    runs[-1] = range(runs[-1].start, index + 1)
                else:
                    runs.append(range(index, index + 1))
        self._num_cached_blocks[request.request_id] = num_full
        for run in runs:
            assert self.kv_events is not None
            self.kv_events.block_stored(
                hashes[run.start : run.stop],
                hashes[run.start - 1] if run.start > 0 else None,
                tokens[run.start * size : run.stop * size],
                size,
            )

    def _offer_blocks_to_disk(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        """Keep for the disk tier the request's full blocks of computed tokens not
        considered yet (of its prompt only, unless generated tokens' blocks are written
        too), that the store lacks and that were not handed out lately.

        The blocks of a pool hit count as computed: a hit on a block of an earlier
        request's answer, now part of this prompt, is how that answer reaches the
        disk. Each block is considered once per admission, so a step that fills
        no new block costs nothing here; the store's in-memory index says what is
        on disk.
        """
        store = self.disk_store
        assert store is not None
        request_id, size = request.request_id, self.block_size
        start = self._num_disk_checked_blocks.get(request_id, 0)
        end = (
            num_full
            if self._disk_write_generated
            else min(num_full, request.num_prompt_tokens // size)
        )
        if end <= start or not store.enabled:
            return
        self._num_disk_checked_blocks[request_id] = end
        hashes, tokens = self.block_hashes(request), request.all_token_ids
        offered = self._offered_to_disk
        for index in range(start, end):
            block_hash = hashes[index]
            if block_hash in store:
                offered.pop(block_hash, None)  # written: the store's index answers from now on
                continue
            if block_hash in offered:
                continue
            offered[block_hash] = None
            if len(offered) > _OFFERED_TO_DISK_RECORD:
                offered.popitem(last=False)
            block_tokens = tuple(tokens[index * size : (index + 1) * size])
            self._stored_for_disk.append(
                StoredBlock(blocks[index].block_id, block_hash, block_tokens)
            )

    def take_stored_blocks(self) -> list[StoredBlock]:
        """The prompt blocks to write, kept since the last call (see :meth:`cache_blocks`).

        Their K/V stay in place until the next allocation: the engine copies
        them out right after the step whose :meth:`cache_blocks` kept them.
        """
        stored, self._stored_for_disk = self._stored_for_disk, []
        return stored

    def forget_offered(self, blocks: Sequence[StoredBlock]) -> None:
        """Blocks taken from :meth:`take_stored_blocks` that were not written (the write
        queue was full): a later prompt that holds them hands them out again."""
        for block in blocks:
            self._offered_to_disk.pop(block.block_hash, None)

    def find_disk_run(self, request: Request) -> DiskRun:
        """The blocks past the pool's hit that the disk tier holds, for a request that
        holds no blocks: the longest run of full blocks (short of its last token,
        as for a pool hit) each in the pool or on disk, ending with one on disk."""
        store = self.disk_store
        hit = self.get_computed_blocks(request)
        if store is None or hit.next_block_hash is None:
            return DiskRun([], [], [])
        hashes = self.block_hashes(request)
        tokens, size = request.all_token_ids, self.block_size
        run_hashes: list[BlockHash] = []
        run_tokens: list[tuple[int, ...]] = []
        run_parents: list[BlockHash | None] = []
        num_taken = 0  # the run's length up to its last block on disk
        for index in range(len(hit.blocks), (request.num_tokens - 1) // size):
            block_tokens = tuple(tokens[index * size : (index + 1) * size])
            if self.block_pool.get_cached_block(hashes[index], block_tokens) is not None:
                continue
            if hashes[index] not in store:
                break
            run_hashes.append(hashes[index])
            run_tokens.append(block_tokens)
            run_parents.append(hashes[index - 1] if index > 0 else None)
            num_taken = len(run_hashes)
        return DiskRun(run_hashes[:num_taken], run_tokens[:num_taken], run_parents[:num_taken])

    def add_loaded_blocks(self, request: Request, run: DiskRun) -> LoadedBlocks:
        """Take free blocks for a run read from disk and enter them into the cache.

        The request's prefix blocks the pool holds are held meanwhile, so that
        taking free blocks for the run never evicts them. Returns the blocks
        to fill (in ``filled``, fewer than the run when some hashes are cached
        already or the free blocks run out); the caller fills them and then
        hands the result to :meth:`release_loaded_blocks`.
        """
        hashes, tokens, size = self.block_hashes(request), request.all_token_ids, self.block_size
        on_disk = dict(zip(run.hashes, run.parent_hashes, strict=True))
        held: dict[int, KVBlock] = {}  # by position
        wanted: list[int] = []  # positions to load
        for index in range((request.num_tokens - 1) // size):
            block_tokens = tokens[index * size : (index + 1) * size]
            block = self.block_pool.get_cached_block(hashes[index], block_tokens)
            if block is not None:
                held[index] = block
            elif hashes[index] in on_disk:
                wanted.append(index)
            else:
                break
        self.block_pool.touch(held.values())
        entries = [(hashes[i], tokens[i * size : (i + 1) * size]) for i in wanted]
        filled = self.block_pool.add_cached_blocks(entries)
        by_hash = {block.block_hash: block for block in filled}
        chain = [held.get(i) or by_hash.get(hashes[i]) for i in sorted([*held, *wanted])]
        if filled and self.kv_events is not None:
            for block in filled:
                assert block.block_hash is not None and block.token_ids is not None
                parent = on_disk[block.block_hash]
                self.kv_events.block_stored([block.block_hash], parent, block.token_ids, size)
        return LoadedBlocks([block for block in chain if block is not None], filled)

    def release_loaded_blocks(self, loaded: LoadedBlocks) -> None:
        """Free the blocks of :meth:`add_loaded_blocks`, now filled, as cached blocks at
        the back of the free queue (the prefix's first block last to be evicted), where
        the request's prefix lookup takes them as hits."""
        self.block_pool.free_blocks(reversed(loaded.chain))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; only while no request holds any (returns success)."""
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> tuple[list[int], ...] | None:
        """Make room in every group for ``num_new_tokens`` tokens after the computed ones.

        ``computed_blocks`` is a prefix-cache hit (from :meth:`get_computed_blocks`)
        for a request that holds no blocks yet; they start its table, and
        ``num_new_tokens`` counts from the end of the hit. Sliding groups first
        give back the blocks wholly before the window. Returns, per group, the
        ids of the blocks added to the request's table (possibly none); or
        None, with nothing changed, when the free blocks (those given back
        now included) do not suffice for all groups.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        request_id = request.request_id
        if not computed_blocks:
            # Most decode steps: every table already reaches the new tokens, nothing to do.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if all(group.covers(request_id, num_tokens) for group in self.groups):
                return tuple([] for _ in self.groups)
        admitted = self.groups[0].holds(request_id)
        if computed_blocks and not self.enable_caching:
            raise ValueError("computed_blocks come from the prefix cache, which is off")
        if computed_blocks and (admitted or request.num_computed_tokens):
            raise ValueError(f"request {request_id!r} already has blocks; a hit must come first")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        num_missing = sum(
            group.num_missing(request_id, num_tokens, len(computed_blocks)) for group in self.groups
        )
        num_releasable = sum(
            group.num_releasable(request_id, num_computed) for group in self.groups
        )
        # Hit blocks nobody holds sit in the free queue: taking them shrinks it too.
        num_hits_from_free = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_missing + num_hits_from_free > self.block_pool.num_free_blocks + num_releasable:
            return None
        if not admitted:
            # Admission: the one moment a request's prefix is looked up.
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_computed
                self._num_cached_blocks[request_id] = len(computed_blocks)
            for group in self.groups:
                group.start(request_id, computed_blocks)
        for group in self.groups:
            group.release_unreachable(request_id, num_computed)
        return tuple(group.extend(request_id, num_tokens) for group in self.groups)

    def release_unreachable_blocks(self, request: Request) -> None:
        """Give back the sliding groups' blocks that no token still to compute will read.

        Called after each step that advanced ``num_computed_tokens``, so the
        blocks return to the pool as soon as the sequence leaves them behind.
        """
        for group in self.groups:
            group.release_unreachable(request.request_id, request.num_computed_tokens)

    def free_blocks_past(self, request: Request, num_tokens: int) -> None:
        """Give back, in every group, the request's blocks past its first ``num_tokens``
        positions (after speculative proposals were rejected)."""
        for group in self.groups:
            group.truncate(request.request_id, num_tokens)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks in every group (finish, abort or preemption)."""
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_disk_checked_blocks.pop(request.request_id, None)
        for group in self.groups:
            group.free(request.request_id)
