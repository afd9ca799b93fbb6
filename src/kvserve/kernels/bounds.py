"""What the C kernels index, checked before they run.

The kernels take block ids, slots and sequence lengths as raw int64 arrays
and trust them: a zero sequence length divides by zero, a block id or a slot
past the pool reads or writes outside it, a sequence longer than its block
table reads past the table's row. The wrappers in :mod:`kvserve.kernels.ops`
run these checks once per call, so a bug upstream becomes an exception that
names the argument, never memory corruption.

Out-of-range indices raise IndexError; wrong dtypes, layouts, shapes and
lengths raise ValueError. Each check is a few tensor reductions over the
step's small index arrays (no per-sequence Python): a few microseconds against
a decode step's milliseconds.

The engine pads with the null block (block 0, see ``core/block_pool.py``),
never with -1: a padded table entry or slot is an ordinary in-range index.
"""

from __future__ import annotations

import torch

_KV_POOL_DTYPES = (torch.float32, torch.bfloat16)


def check_kv_pool(kv_cache: torch.Tensor) -> None:
    """The pool the kernels read and write by raw address.

    kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, float32 or bfloat16,
    contiguous, on the CPU.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"not {tuple(kv_cache.shape)}"
        )
    if (
        not kv_cache.is_contiguous()
        or kv_cache.dtype not in _KV_POOL_DTYPES
        or kv_cache.device.type != "cpu"
    ):
        raise ValueError("kv_cache must be a contiguous float32 or bfloat16 KV pool on CPU")


def check_float_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """``tensor`` is float32 on the CPU with exactly ``shape`` (the kernels trust both)."""
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise ValueError(
            f"{name} must be a float32 CPU tensor, not {tensor.dtype} on {tensor.device}"
        )
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, not {tuple(tensor.shape)}")


def _check_index_tensor(name: str, tensor: torch.Tensor, ndim: int, rows: int) -> None:
    """int64 on the CPU, ``ndim`` dimensions, ``rows`` long, last dimension contiguous.

    The kernels walk the last dimension element by element from the row's address;
    the rows of a table may be further apart (a column slice of a wider table).
    """
    if tensor.dtype != torch.int64 or tensor.device.type != "cpu":
        raise ValueError(
            f"{name} must be an int64 CPU tensor, not {tensor.dtype} on {tensor.device}"
        )
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), not shape {tuple(tensor.shape)}")
    if tensor.shape[0] != rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {rows}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int) -> None:
    """``slot_mapping`` ``[num_tokens]`` int64, each slot in ``[0, num_slots)``."""
    _check_index_tensor("slot_mapping", slot_mapping, 1, num_tokens)
    if num_tokens == 0:
        return
    lowest, highest = (int(v) for v in torch.aminmax(slot_mapping))
    if lowest < 0 or highest >= num_slots:
        bad = lowest if lowest < 0 else highest
        raise IndexError(f"slot_mapping holds slot {bad}, outside the pool's [0, {num_slots})")


def check_decode_tables(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """The decode rows' block tables and lengths, against a pool of ``num_blocks`` blocks.

    block_tables: ``[num_seqs, width]`` int64 with contiguous rows; seq_lens:
    ``[num_seqs]`` int64 with ``0 < seq_len <= width * block_size``. Every
    block a sequence uses (its first ``ceil(seq_len / block_size)`` entries)
    must be in ``[0, num_blocks)``; entries past that are never read.
    """
    _check_index_tensor("block_tables", block_tables, 2, num_seqs)
    _check_index_tensor("seq_lens", seq_lens, 1, num_seqs)
    if num_seqs == 0:
        raise ValueError("the decode kernels need at least one sequence")
    width = block_tables.shape[1]
    shortest, longest = (int(v) for v in torch.aminmax(seq_lens))
    if shortest < 1:
        raise ValueError(f"seq_lens holds {shortest}: every decode row has at least 1 token")
    if longest > width * block_size:
        raise ValueError(
            f"seq_lens holds {longest} tokens, more than block_tables' {width} blocks "
            f"of {block_size} hold"
        )
    lowest, highest = (int(v) for v in torch.aminmax(block_tables))
    if lowest >= 0 and highest < num_blocks:
        return  # the whole table is in range: the common case, one reduction
    # Something is out of range; it matters only inside a sequence's used blocks.
    blocks_used = (seq_lens + block_size - 1) // block_size
    in_use = torch.arange(width) < blocks_used[:, None]
    bad = block_tables[in_use & ((block_tables < 0) | (block_tables >= num_blocks))]
    if bad.numel():
        raise IndexError(
            f"block_tables holds block {int(bad[0])}, outside the pool's [0, {num_blocks})"
        )
