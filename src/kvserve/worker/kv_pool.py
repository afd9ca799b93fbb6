"""The KV pool: its size, its layout in KV cache groups, and its allocation without
committing memory up front.

Layout: the pool is ``[G, 2, num_blocks, block_size, Hkv, D]``, where ``G``
is the size of the largest KV cache group (``core/kv_cache_groups.py``): every
layer of a model with one attention type, or 3 for a model of 15 sliding
and 3 global layers. Layer ``j`` of each group is bound to tensor ``j``; a
block id, held by one group at a time, stands for ``G`` layers' K/V of
``block_size`` tokens, and the pool is sized in such blocks.

Default size: without a KV setting, the pool holds what ``max_num_seqs``
sequences of ``min(max_model_len, DEFAULT_EXPECTED_SEQ_TOKENS)`` tokens use
(see that constant in :mod:`kvserve.config.cache` for why 512), and never less
than one sequence of ``max_model_len`` tokens, so every request the engine
accepts can run. The memory budget (a fifth of available memory, at most
4 GiB) still caps it. Longer sequences than expected are not refused: when
blocks run out the scheduler preempts, and the preempted request resumes
later. With sliding-window groups a sequence needs fewer blocks: a sliding
group holds at most the window (plus a block) and the chunk being computed.

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
from collections.abc import Sequence

import psutil
import torch

from kvserve.config.cache import (
    DEFAULT_EXPECTED_SEQ_TOKENS,
    DEFAULT_KV_CACHE_CAP_BYTES,
    DEFAULT_KV_CACHE_FRACTION,
    CacheConfig,
)
from kvserve.core.kv_cache_groups import (
    KVCacheGroupSpec,
    blocks_for_sequence,
    cdiv,
    num_pool_layers,
)
from kvserve.errors import InvalidParameterError
from kvserve.layers.attention import Attention
from kvserve.models.arch_config import ArchConfig


def kv_cache_bytes_per_block(
    arch: ArchConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """Bytes one block takes: K and V of ``block_size`` tokens in ``num_layers`` layers.

    num_layers: the pool's depth ``G`` (see :func:`num_pool_layers`); None means
    every layer (one attention type).
    """
    element_size = torch.empty((), dtype=dtype).element_size()
    layers = arch.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * arch.num_key_value_heads * arch.head_dim * element_size * block_size


def kv_bytes_per_sequence(
    arch: ArchConfig,
    groups: Sequence[KVCacheGroupSpec],
    num_tokens: int,
    block_size: int,
    dtype: torch.dtype,
    keep_full_history: bool = False,
) -> int:
    """KV bytes one decoding sequence of ``num_tokens`` tokens holds at most.

    Each group holds its blocks (a sliding group: its window plus a block)
    of ``G`` layers each. keep_full_history: instead, what every layer
    keeping every position takes (the cache without sliding-window freeing,
    in blocks of every layer).
    """
    if keep_full_history:
        return cdiv(num_tokens, block_size) * kv_cache_bytes_per_block(arch, block_size, dtype)
    windows = tuple(group.sliding_window for group in groups)
    num_blocks = blocks_for_sequence(windows, num_tokens, block_size, max_chunk_tokens=1)
    return num_blocks * kv_cache_bytes_per_block(arch, block_size, dtype, num_pool_layers(groups))


def expected_kv_blocks(
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    sliding_windows: Sequence[int | None] = (None,),
    max_chunk_tokens: int | None = None,
) -> int:
    """Blocks (the null block included) the default pool wants before the memory cap.

    ``max_num_seqs`` sequences of ``min(max_model_len, DEFAULT_EXPECTED_SEQ_TOKENS)``
    tokens (decoding; each sliding group also holds one step's chunk), and at
    least one sequence of ``max_model_len`` tokens. ``sliding_windows``: each
    KV cache group's window (None: global); ``max_chunk_tokens``: the most
    tokens a step computes (None: a whole sequence).
    """
    expected_len = min(max_model_len, DEFAULT_EXPECTED_SEQ_TOKENS)
    chunk = max_model_len if max_chunk_tokens is None else min(max_chunk_tokens, max_model_len)
    decoding = max_num_seqs * blocks_for_sequence(sliding_windows, expected_len, block_size, 1)
    in_flight = sum(cdiv(chunk, block_size) for window in sliding_windows if window is not None)
    longest = blocks_for_sequence(sliding_windows, max_model_len, block_size, max_chunk_tokens)
    return max(decoding + in_flight, longest) + 1


def num_kv_blocks(
    cache_config: CacheConfig,
    arch: ArchConfig,
    dtype: torch.dtype,
    max_model_len: int,
    max_num_seqs: int,
    groups: Sequence[KVCacheGroupSpec] | None = None,
    max_chunk_tokens: int | None = None,
) -> int:
    """How many blocks (the null block included) the KV budget buys.

    With a budget set, never more than ``max_num_seqs`` full-length sequences
    can use: memory beyond that would sit idle. Without one, what the expected
    load uses (see :func:`expected_kv_blocks`), within the default budget.
    ``groups``: the model's KV cache groups (None: one group of every layer);
    ``max_chunk_tokens``: the most tokens a step computes.
    """
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    block_size = cache_config.block_size
    windows = (None,) if groups is None else tuple(g.sliding_window for g in groups)
    per_sequence = blocks_for_sequence(windows, max_model_len, block_size, max_chunk_tokens)
    useful = max_num_seqs * per_sequence + 1
    if cache_config.kv_cache_memory_bytes is not None:
        budget = cache_config.kv_cache_memory_bytes
    else:
        available = psutil.virtual_memory().available
        if cache_config.kv_cache_memory_fraction is not None:
            budget = int(available * cache_config.kv_cache_memory_fraction)
        else:
            budget = min(int(available * DEFAULT_KV_CACHE_FRACTION), DEFAULT_KV_CACHE_CAP_BYTES)
            useful = expected_kv_blocks(
                max_num_seqs, max_model_len, block_size, windows, max_chunk_tokens
            )
    num_layers = None if groups is None else num_pool_layers(groups)
    per_block = kv_cache_bytes_per_block(arch, block_size, dtype, num_layers)
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 2:
        raise InvalidParameterError(
            "kv_cache_memory_bytes",
            f"the KV budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes",
        )
    return num_blocks


def bind_kv_pool(
    layers: Sequence[Attention], groups: Sequence[KVCacheGroupSpec], pool: torch.Tensor
) -> None:
    """Bind layer ``j`` of each group to ``pool[j]`` and tell it its group's index.

    layers: the model's attention layers in module order; pool:
    ``[G, 2, num_blocks, block_size, Hkv, D]``.
    """
    for group_index, group in enumerate(groups):
        for tensor_index, layer_index in enumerate(group.layer_indices):
            layers[layer_index].kv_cache = pool[tensor_index]
            layers[layer_index].kv_group = group_index


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
