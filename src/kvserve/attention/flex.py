"""Paged attention through PyTorch's FlexAttention: one fused call for the whole flat batch.

Decode rows and prefill chunks go through a single ``flex_attention`` call per
layer: the queries of the step against the whole KV pool, viewed in place as
one long key sequence, with a ``BlockMask`` that lists, per block of query
rows, the physical pages of that request it may read (``flex_blocks.py``).
The translation from block tables to the mask is built once per step and KV
cache group (by the first layer that needs it; sliding-window layers get
their own), and every layer reuses it. Grouped-query heads read their KV
head directly (``enable_gqa``): K/V are never copied. Soft-capped scores
(Gemma 2) go through a ``score_mod``.

On CPU each query row is its own block (``q_block_size`` 1): a block then
reads exactly its request's pages. On CUDA the Triton kernel needs blocks of
at least 16 rows, so each request's queries are padded to a multiple of 16
in the attention layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvserve.attention.backend import AttentionBackend, write_kv_cache
from kvserve.attention.flex_blocks import FlexBlockLayout, build_block_layout
from kvserve.attention.flex_compile import compiled_flex_attention
from kvserve.attention.metadata import AttentionMetadata

CPU_Q_BLOCK_SIZE = 1
CUDA_Q_BLOCK_SIZE = 16


@dataclass(frozen=True)
class FlexMetadata(AttentionMetadata):
    """The shared layout plus, per sliding window, its FlexAttention block layout and mask.

    built: window (None: global) → the :class:`FlexBlockLayout` and its
        ``BlockMask``, filled by the step's first layer with that window (or by
        :meth:`FlexAttention.prepare`, ahead of a CUDA graph).
    """

    built: dict[int | None, tuple[FlexBlockLayout, BlockMask]] = field(
        default_factory=dict, compare=False, repr=False
    )


def soft_cap_score_mod(cap: float) -> Callable[..., torch.Tensor]:
    """A ``score_mod`` squashing scaled scores to ``cap * tanh(score / cap)``."""

    def soft_cap(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return soft_cap


class FlexAttention(AttentionBackend):
    """FlexAttention over the page pool (``flex_blocks.py`` for the translation).

    device: where the pool lives (picks the query block size);
    max_blocks_per_seq: the most pages one sequence holds (``kv_indices``'
    width on CUDA; on CPU the compiled kernel wants the pool's width).
    """

    name = "flex"

    def __init__(self, device: torch.device, max_blocks_per_seq: int) -> None:
        self.q_block_size = CPU_Q_BLOCK_SIZE if device.type == "cpu" else CUDA_Q_BLOCK_SIZE
        self.on_cpu = device.type == "cpu"
        self.max_blocks_per_seq = max_blocks_per_seq
        self.score_mods: dict[float, Callable[..., torch.Tensor]] = {}

    def build_metadata(self, layout: AttentionMetadata, dtype: torch.dtype) -> FlexMetadata:
        """The layout, ready to hold the block layouts its layers build (once each)."""
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(AttentionMetadata)}
        return FlexMetadata(**fields)

    def prepare(
        self,
        md: FlexMetadata,
        sliding_window: int | None,
        num_pool_blocks: int,
        num_rows: int | None = None,
    ) -> tuple[FlexBlockLayout, BlockMask]:
        """The block layout and ``BlockMask`` of ``md`` for layers with ``sliding_window``.

        num_rows: attention rows, fixed by a CUDA graph; default: the step's bucket.
        """
        cached = md.built.get(sliding_window)
        if cached is None:
            width = (
                num_pool_blocks if self.on_cpu else min(num_pool_blocks, self.max_blocks_per_seq)
            )
            blocks = build_block_layout(
                md, sliding_window, self.q_block_size, num_pool_blocks, width, num_rows
            )
            cached = md.built[sliding_window] = (blocks, blocks.block_mask())
        return cached

    def _cuda_kernel_options(self, block_size: int) -> dict[str, object]:
        """The Triton kernel's tiles, one query block by one page: a tile never spans two
        pages, which the pool does not hold side by side (block_size >= 16 for Triton)."""
        return {"BACKEND": "TRITON", "BLOCK_M": self.q_block_size, "BLOCK_N": block_size}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        md = attn_metadata
        if not isinstance(md, FlexMetadata):
            md = self.build_metadata(md, query.dtype)
        write_kv_cache(key, value, kv_cache, md.slot_mapping)
        num_pool_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        blocks, block_mask = self.prepare(md, sliding_window, num_pool_blocks)
        num_heads = query.shape[1]
        # FlexAttention takes one dtype; a narrower pool than the activations sets it.
        pool_dtype = kv_cache.dtype
        rows_HRD = query.new_zeros((num_heads, blocks.num_rows, head_dim), dtype=pool_dtype)
        rows_HRD[:, blocks.rows] = query.transpose(0, 1).to(pool_dtype)
        num_keys = num_pool_blocks * block_size
        # [1, Hkv, num_keys, D]: the pool's K and V as one key sequence, viewed in place.
        keys = kv_cache[0].view(1, num_keys, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1].view(1, num_keys, num_kv_heads, head_dim).transpose(1, 2)
        score_mod = None
        if soft_cap is not None:
            score_mod = self.score_mods.setdefault(soft_cap, soft_cap_score_mod(soft_cap))
        out = compiled_flex_attention()(
            rows_HRD[None],
            keys,
            values,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
            kernel_options=None if self.on_cpu else self._cuda_kernel_options(block_size),
        )
        return out[0][:, blocks.rows].transpose(0, 1).to(query.dtype)
