"""Paged attention through PyTorch's FlexAttention: one fused call for the whole flat batch.

Decode rows and prefill chunks go through a single ``flex_attention`` call per
layer: the queries of the step against the whole KV pool, viewed in place as
one long key sequence, with a ``BlockMask`` that lists, per block of query
rows, the physical pages of that request it may read (``flex_blocks.py``).
The translation from block tables to the mask is built once per step and KV
cache group, for the group's sliding window, before the first layer runs,
and every layer of the group reuses it. Grouped-query heads read their KV
head directly (``enable_gqa``): K/V are never copied. Soft-capped scores
(Gemma 2) go through a ``score_mod``.

On CPU each query row is its own block (``q_block_size`` 1): a block then
reads exactly its request's pages. On CUDA the Triton kernel needs blocks of
at least 16 rows, so each request's queries are padded to a multiple of 16
in the attention layout.

Decode-only steps on CUDA take the *per-row* form instead: each row is its
own batch entry with one query, against the same pool (batch 1, broadcast),
and the mask lists that row's pages (``FlexBlockLayout.block_mask(per_row=True)``).
That is the shape FlexAttention's decoding kernel takes: the query heads that
share a KV head are packed into one tile, so each page is read once per KV
head, and a row's pages are split across programs when there are few rows.
The one-sequence form would read every page once per query head, in tiles
of 16 rows of which one is the page's request's.

Decode steps on CUDA are replayed as CUDA graphs (``worker/cuda_graphs.py``):
the capture hooks build a group's slot mapping and block layout in buffers
that later steps are copied into, at their addresses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvserve.attention.backend import AttentionBackend, write_kv_cache
from kvserve.attention.flex_blocks import (
    PER_ROW_Q_BLOCK,
    FlexBlockLayout,
    build_block_layout,
    copy_layout,
    padded_rows,
    rows_bucket,
)
from kvserve.attention.flex_compile import compiled_flex_attention
from kvserve.attention.metadata import AttentionLayout, AttentionMetadata

CPU_Q_BLOCK_SIZE = 1
CUDA_Q_BLOCK_SIZE = 16


@dataclass(frozen=True)
class FlexMetadata:
    """One KV cache group's layout, its FlexAttention block layout and that layout's mask.

    blocks: the group's block tables translated for its sliding window
        (:func:`~kvserve.attention.flex_blocks.build_block_layout`).
    block_mask: ``blocks.block_mask(per_row)``, built once with the metadata.
    per_row: the decode form (one batch entry per row; see the module's text).
    """

    layout: AttentionLayout
    blocks: FlexBlockLayout
    block_mask: BlockMask
    per_row: bool = False


def soft_cap_score_mod(cap: float) -> Callable[..., torch.Tensor]:
    """A ``score_mod`` squashing scaled scores to ``cap * tanh(score / cap)``."""

    def soft_cap(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return soft_cap


class FlexAttention(AttentionBackend[FlexMetadata]):
    """FlexAttention over the page pool (``flex_blocks.py`` for the translation).

    device: where the pool lives (picks the query block size);
    max_blocks_per_seq: the most pages one sequence holds (``kv_indices``'
    width on CUDA; on CPU the compiled kernel wants the pool's width);
    per_row_decode: decode-only steps in the per-row form (default: on CUDA).
    """

    name = "flex"

    def __init__(
        self, device: torch.device, max_blocks_per_seq: int, per_row_decode: bool | None = None
    ) -> None:
        self.q_block_size = CPU_Q_BLOCK_SIZE if device.type == "cpu" else CUDA_Q_BLOCK_SIZE
        self.on_cpu = device.type == "cpu"
        self.max_blocks_per_seq = max_blocks_per_seq
        self.per_row_decode = not self.on_cpu if per_row_decode is None else per_row_decode
        self.score_mods: dict[float, Callable[..., torch.Tensor]] = {}

    def _per_row(self, layout: AttentionLayout) -> bool:
        """Does this step take the per-row form? (Decode rows only, and the form is on.)"""
        return self.per_row_decode and not layout.prefills

    def _block_layout(
        self,
        layout: AttentionLayout,
        num_pool_blocks: int,
        num_rows: int | None = None,
        per_row: bool = False,
    ) -> FlexBlockLayout:
        """``layout``'s block tables as this backend reads them over a pool of
        ``num_pool_blocks`` pages; num_rows: attention rows (default: the step's bucket;
        per row, buckets from 1: the row count is the decoding kernel's batch, which sets
        how finely it splits each row's keys)."""
        width = num_pool_blocks if self.on_cpu else min(num_pool_blocks, self.max_blocks_per_seq)
        if per_row:
            if num_rows is None:
                num_rows = self._attention_rows(layout.num_tokens, per_row=True)
            return build_block_layout(layout, 1, num_pool_blocks, width, num_rows)
        return build_block_layout(layout, self.q_block_size, num_pool_blocks, width, num_rows)

    def _attention_rows(self, num_rows: int, per_row: bool) -> int:
        """Attention rows that hold a step of ``num_rows`` query rows in any arrangement:
        per row, the bucket of ``num_rows`` from 1 (the row count is the decoding
        kernel's batch, which sets how finely it splits each row's keys); otherwise the
        bucket of one query block per row, the most the step can need."""
        if per_row:
            return rows_bucket(num_rows, smallest=1)
        return rows_bucket(num_rows * self.q_block_size)

    def build_group(
        self, layout: AttentionLayout, dtype: torch.dtype, num_pool_blocks: int
    ) -> FlexMetadata:
        """The group's block layout and ``BlockMask`` (FlexAttention needs no dtype)."""
        per_row = self._per_row(layout)
        blocks = self._block_layout(layout, num_pool_blocks, per_row=per_row)
        return FlexMetadata(layout, blocks, blocks.block_mask(per_row), per_row)

    def capture_metadata(
        self, layouts: Sequence[AttentionLayout], num_rows: int, num_pool_blocks: int
    ) -> AttentionMetadata[FlexMetadata]:
        """See :meth:`AttentionBackend.capture_metadata`. The buffers: each group's slot
        mapping (``[num_rows]``) and block layout (attention rows: the bucket of
        ``num_rows`` query blocks); the rest of a captured layout is the capturing
        step's, which FlexAttention does not read."""
        per_row = self.per_row_decode
        attention_rows = self._attention_rows(num_rows, per_row)
        groups = []
        for layout in layouts:
            num_tokens = layout.num_tokens
            blocks = padded_rows(
                self._block_layout(layout, num_pool_blocks, attention_rows, per_row),
                num_tokens,
                num_rows,
            )
            slots = layout.slot_mapping.new_zeros(num_rows)  # padding rows write slot 0
            slots[:num_tokens] = layout.slot_mapping
            static = dataclasses.replace(layout, slot_mapping=slots, num_decode_tokens=num_rows)
            groups.append(FlexMetadata(static, blocks, blocks.block_mask(per_row), per_row))
        return AttentionMetadata(tuple(groups))

    def copy_for_replay(
        self, captured: AttentionMetadata[FlexMetadata], layouts: Sequence[AttentionLayout]
    ) -> None:
        """See :meth:`AttentionBackend.copy_for_replay`: slot mappings and block layouts."""
        for static, layout in zip(captured.groups, layouts, strict=True):
            num_tokens, num_rows = layout.num_tokens, static.layout.num_tokens
            static.layout.slot_mapping[:num_tokens].copy_(layout.slot_mapping)
            static.layout.slot_mapping[num_tokens:].zero_()
            fresh = self._block_layout(
                layout, static.blocks.num_pool_blocks, static.blocks.num_rows, static.per_row
            )
            copy_layout(static.blocks, fresh, num_tokens, num_rows)

    def _cuda_kernel_options(self, block_size: int, per_row: bool) -> dict[str, object]:
        """The Triton kernel's tiles, one query block by one page: a tile never spans two
        pages, which the pool does not hold side by side (block_size >= 16 for Triton).
        Per row, FlexAttention picks its kernel: the decoding one where the query heads
        per KV head are a power of two, else the main one, one row's heads per tile."""
        if per_row:
            return {"BLOCK_M": PER_ROW_Q_BLOCK, "BLOCK_N": block_size}
        return {"BACKEND": "TRITON", "BLOCK_M": self.q_block_size, "BLOCK_N": block_size}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlexMetadata,
        scale: float,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.layout.slot_mapping)
        num_pool_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        blocks = metadata.blocks
        num_heads = query.shape[1]
        # FlexAttention takes one dtype; a narrower pool than the activations sets it.
        pool_dtype = kv_cache.dtype
        if metadata.per_row:
            # [R, H, 1, D]: each row its own batch entry of one query.
            rows_RHD = query.new_zeros((blocks.num_rows, num_heads, head_dim), dtype=pool_dtype)
            rows_RHD[blocks.rows] = query.to(pool_dtype)
            queries = rows_RHD[:, :, None]
        else:
            # [1, H, R, D]: the rows as one query sequence.
            rows_HRD = query.new_zeros((num_heads, blocks.num_rows, head_dim), dtype=pool_dtype)
            rows_HRD[:, blocks.rows] = query.transpose(0, 1).to(pool_dtype)
            queries = rows_HRD[None]
        num_keys = num_pool_blocks * block_size
        # [1, Hkv, num_keys, D]: the pool's K and V as one key sequence, viewed in place.
        keys = kv_cache[0].view(1, num_keys, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1].view(1, num_keys, num_kv_heads, head_dim).transpose(1, 2)
        score_mod = None
        if soft_cap is not None:
            score_mod = self.score_mods.setdefault(soft_cap, soft_cap_score_mod(soft_cap))
        kernel_options = None
        if not self.on_cpu:
            kernel_options = self._cuda_kernel_options(block_size, metadata.per_row)
        out = compiled_flex_attention()(
            queries,
            keys,
            values,
            score_mod=score_mod,
            block_mask=metadata.block_mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
            kernel_options=kernel_options,
        )
        if metadata.per_row:
            return out[blocks.rows, :, 0].to(query.dtype)
        return out[0][:, blocks.rows].transpose(0, 1).to(query.dtype)
