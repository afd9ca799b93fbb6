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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvserve.core.block_hash import BlockHash, extend_block_hashes
from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


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
    """Per-request block tables over a shared :class:`BlockPool`.

    enable_caching: look up and fill the prefix cache. The engine passes
    ``CacheConfig.enable_prefix_caching`` (on by default); a bare manager
    leaves it off.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self._req_to_blocks: dict[str, list[KVBlock]] = {}
        # Per request: how many leading blocks of its table are in the cache already.
        self._num_cached_blocks: dict[str, int] = {}
        # Cumulative, in tokens, counted when a request is admitted.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits the whole pool, with nothing else in it."""
        return self.num_blocks_for(num_tokens) <= self.num_usable_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (block ids in token order)."""
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._req_to_blocks.get(request_id, ()))

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
        if not self.enable_caching or request.request_id in self._req_to_blocks:
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
        then are the blocks' K/V written.
        """
        blocks = self._req_to_blocks.get(request.request_id)
        if not self.enable_caching or blocks is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        hashes = self.block_hashes(request)
        tokens, size = request.all_token_ids, self.block_size
        for index in range(num_cached, num_full):
            self.block_pool.cache_block(
                blocks[index], hashes[index], tokens[index * size : (index + 1) * size]
            )
        self._num_cached_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; only while no request holds any (returns success)."""
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` tokens after the request's computed ones.

        ``computed_blocks`` is a prefix-cache hit (from :meth:`get_computed_blocks`)
        for a request that holds no blocks yet; they start its table, and
        ``num_new_tokens`` counts from the end of the hit. Returns the ids of
        the blocks added to its table (possibly none), or None, with nothing
        changed, when the free blocks do not suffice.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        request_id = request.request_id
        blocks = self._req_to_blocks.get(request_id, [])
        if computed_blocks and (blocks or request.num_computed_tokens):
            raise ValueError(f"request {request_id!r} already has blocks; a hit must come first")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.num_blocks_for(num_computed + num_new_tokens)
        num_missing = num_required - len(blocks) - len(computed_blocks)
        # Hit blocks nobody holds sit in the free queue: taking them shrinks it too.
        num_hits_from_free = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if max(num_missing, 0) + num_hits_from_free > self.block_pool.num_free_blocks:
            return None
        if request_id not in self._req_to_blocks:
            # Admission: the one moment a request's prefix is looked up.
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_computed
                self._num_cached_blocks[request_id] = len(computed_blocks)
            self.block_pool.touch(computed_blocks)
            self._req_to_blocks[request_id] = blocks = list(computed_blocks)
        if num_missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_missing)
        blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Release all of the request's blocks at once (finish, abort or preemption)."""
        blocks = self._req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
