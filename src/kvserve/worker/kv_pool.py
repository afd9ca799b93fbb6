"""The KV pool's default size, and its allocation without committing memory up front.

Default size: without a KV setting, the pool holds what ``max_num_seqs``
sequences of ``min(max_model_len, DEFAULT_EXPECTED_SEQ_TOKENS)`` tokens use
(see that constant in :mod:`kvserve.config` for why 512), and never less
than one sequence of ``max_model_len`` tokens, so every request the engine
accepts can run. The memory budget (a fifth of available memory, at most
4 GiB) still caps it. Longer sequences than expected are not refused: when
blocks run out the scheduler preempts, and the preempted request resumes
later.

Allocation: the pool must read as zeros (the null block and never-written
slots are read under a mask, and 0 * NaN would still be NaN), but
``torch.zeros`` writes every page, making the whole pool resident at start.
A fresh private anonymous mapping reads as zeros already, and the kernel
backs a page only when it is first written; so the pool costs memory as
blocks are used, not when it is sized.
"""

from __future__ import annotations

import math
import mmap

import torch

from kvserve.config import DEFAULT_EXPECTED_SEQ_TOKENS
from kvserve.core.kv_cache_manager import cdiv


def expected_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks (the null block included) the default pool wants before the memory cap.

    ``max_num_seqs`` sequences of ``min(max_model_len, DEFAULT_EXPECTED_SEQ_TOKENS)``
    tokens, and at least one sequence of ``max_model_len`` tokens.
    """
    expected_len = min(max_model_len, DEFAULT_EXPECTED_SEQ_TOKENS)
    num_data_blocks = max(
        max_num_seqs * cdiv(expected_len, block_size), cdiv(max_model_len, block_size)
    )
    return num_data_blocks + 1


def zeroed_pool(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(*shape, dtype=dtype, device=device)``, resident only where written.

    On CPU the tensor is backed by a private anonymous mapping (page-aligned,
    contiguous) that it keeps alive. Other devices, and platforms without
    such mappings, get ``torch.zeros``.
    """
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    private = getattr(mmap, "MAP_PRIVATE", None)
    if device.type != "cpu" or num_bytes == 0 or private is None:
        return torch.zeros(*shape, dtype=dtype, device=device)
    # fileno -1: anonymous memory, which the kernel hands out zero-filled.
    mapping = mmap.mmap(-1, num_bytes, flags=private)
    return torch.frombuffer(mapping, dtype=dtype).view(*shape)
