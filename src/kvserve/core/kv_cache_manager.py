"""The scheduler's only view of KV memory.

It maps each request to the blocks that hold its K/V (its block table) and
grows or frees that table. It never touches tensors: slots are numbers, and
``worker/`` turns them into a ``slot_mapping`` at the device boundary.
"""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over a shared :class:`BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self._req_to_blocks: dict[str, list[KVBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

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

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` tokens after the request's computed ones.

        Returns the ids of the blocks added to its table (possibly none), or
        None, with nothing changed, when the free blocks do not suffice.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        blocks = self._req_to_blocks.setdefault(request.request_id, [])
        num_required = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        num_missing = num_required - len(blocks)
        if num_missing <= 0:
            return []
        if num_missing > self.block_pool.num_free_blocks:
            if not blocks:
                del self._req_to_blocks[request.request_id]
            return None
        new_blocks = self.block_pool.get_new_blocks(num_missing)
        blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Release all of the request's blocks at once (finish, abort or preemption)."""
        blocks = self._req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
