"""Whole KV blocks out of the pool and back in, as bytes (the prefix cache's disk tier).

A block's bytes are its K/V in every pool layer, laid out ``[G, 2, block_size,
Hkv, D]`` in the pool's dtype: exactly what the pool holds for it, so a block
read back is bit for bit the block written. The pool is
``[G, 2, num_blocks, block_size, Hkv, D]`` (``kv_pool.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_blocks_out(pool: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """A host copy of the blocks' K/V, ``[n, G, 2, block_size, Hkv, D]``, contiguous.

    A copy, not a view: the pool's blocks are reused as soon as the step ends.
    """
    index = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    rows = pool.index_select(2, index).to("cpu")  # [G, 2, n, bs, Hkv, D]
    return rows.permute(2, 0, 1, 3, 4, 5).contiguous()


def block_bytes(blocks: torch.Tensor, index: int) -> memoryview:
    """The bytes of block ``index`` of a :func:`copy_blocks_out` result, as a view of
    ``blocks`` (no copy: valid while ``blocks`` is)."""
    return blocks[index].reshape(-1).view(torch.uint8).numpy().data


def copy_blocks_in(pool: torch.Tensor, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Write each payload (:func:`block_bytes` of a block of this pool's shape and
    dtype) into the pool's block of the same position in ``block_ids``."""
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
    if not block_ids:
        return
    layers, kv, _, block_size, heads, head_dim = pool.shape
    data = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8)  # one copy, writable
    blocks = data.view(pool.dtype).view(len(payloads), layers, kv, block_size, heads, head_dim)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    pool.index_copy_(2, index, blocks.permute(1, 2, 0, 3, 4, 5).to(pool.device))
