"""Fixed-size KV blocks: reference counts and the free queue.

Block 0 is the null block. It is never handed out; block tables are padded
with it, so the attention kernels can gather a rectangle of blocks without a
branch for "no block here".

The free queue is ordered: blocks are taken from the front and returned to the
back. That order is what an eviction policy needs once freed blocks keep
reusable contents (prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK_ID = 0


class KVBlock:
    """One block of ``block_size`` token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    """Owns every block; hands free ones out and takes them back.

    Invariant: a block is in the free queue exactly when its ``ref_cnt`` is 0
    and it is not the null block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # Block ids in eviction order; an OrderedDict gives O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold data: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds go to the back of the queue.

        Pass a request's blocks tail first: its last blocks are then the first
        to be reused, which keeps shared prefixes around longest.
        """
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise AssertionError(f"freeing {block}, which is not held")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
