"""Paged attention in plain PyTorch: runs on any device, the default on CPU.

Decode queries of all requests are handled together: their pages are gathered
into one ``[batch, kv_len]`` rectangle (the null block pads short tables; a
length mask hides the padding) and attended in one call. Grouped-query heads
ride along as extra query rows, so K/V are never repeated per query head.

Prefill chunks are attended one request at a time; a step holds few of them,
and each is a large matrix product on its own.

Every mask is built once per step and KV cache group, for the group's sliding
window, before the first layer runs; a prefill chunk under a window gathers
only the blocks its window reaches. Soft-capped scores (Gemma 2) need the
scores themselves, which PyTorch's fused attention never shows: those layers
attend through :func:`attend_math`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention import masks as visibility
from kvserve.attention.backend import AttentionBackend, write_kv_cache
from kvserve.attention.cascade import cascade_decode, common_prefix_len
from kvserve.attention.metadata import AttentionLayout, PrefillChunk
from kvserve.attention.soft_cap import attend_math


@dataclass(frozen=True)
class TorchPagedMetadata:
    """One KV cache group's layout and the masks this backend attends it with.

    layout: the group's layout; its ``sliding_window`` shapes every mask here.
    decode_mask: ``[num_decode_tokens, 1, 1, num_blocks * block_size]``
        additive mask in the activations' dtype: 0 for the slots that hold the
        request's keys (within the window), -inf elsewhere; None when the
        step has no decode rows or they are not attended here.
    chunk_masks: per prefill chunk, ``[query_len, seq_len - first_key]``
        additive mask over the keys from ``masks.first_key`` on, 0 where query
        i may see key j, -inf elsewhere; None for a chunk that plain causal
        attention over itself answers (``masks.chunk_mask``).
    decode_common_prefix_len: the first this-many positions of every decode
        row sit in the same blocks (a prefix-cache hit they share), so they are
        attended once for all rows (cascade); 0 when there is none worth it,
        and always 0 under a sliding window.
    """

    layout: AttentionLayout
    decode_mask: torch.Tensor | None = None
    chunk_masks: tuple[torch.Tensor | None, ...] = ()
    decode_common_prefix_len: int = 0


class TorchPagedAttention(AttentionBackend[TorchPagedMetadata]):
    name = "torch_paged"

    def build_group(
        self,
        layout: AttentionLayout,
        dtype: torch.dtype,
        num_pool_blocks: int,
        decodes: bool = True,
    ) -> TorchPagedMetadata:
        """Masks in ``dtype`` for the layout's window, and the cascade decision;
        ``decodes=False`` skips the decode rows' (for a backend that attends to
        them itself). The pool's size does not matter here."""
        window = layout.sliding_window
        decode_mask = None
        prefix_len = 0
        if decodes and layout.num_decode_tokens:
            decode_mask = visibility.decode_mask(layout, dtype)
            if window is None:  # cascade attends whole prefixes: for global layers only
                prefix_len = common_prefix_len(
                    layout.decode_block_tables, layout.decode_seq_lens, layout.block_size
                )
        chunk_masks = tuple(
            visibility.chunk_mask(chunk, dtype, window, layout.block_size)
            for chunk in layout.prefills
        )
        return TorchPagedMetadata(layout, decode_mask, chunk_masks, prefix_len)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchPagedMetadata,
        scale: float,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        md = metadata
        write_kv_cache(key, value, kv_cache, md.layout.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = md.layout.num_decode_tokens
        if num_decodes and md.decode_common_prefix_len and soft_cap is None:
            assert md.decode_mask is not None
            output[:num_decodes] = cascade_decode(
                query[:num_decodes],
                kv_cache,
                md.layout.decode_block_tables,
                md.decode_mask,
                md.decode_common_prefix_len,
                scale,
            )
        elif num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, md, scale, soft_cap)
        self.prefill_into(output, query, key, value, kv_cache, md, scale, soft_cap)
        return output

    def prefill_into(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchPagedMetadata,
        scale: float,
        soft_cap: float | None = None,
    ) -> None:
        """Attend each prefill chunk and write it to its rows of ``output``."""
        layout = metadata.layout
        for chunk, mask in zip(layout.prefills, metadata.chunk_masks, strict=True):
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            start = visibility.first_key(chunk, layout.sliding_window, layout.block_size)
            output[rows] = self._prefill(
                query[rows], key[rows], value[rows], kv_cache, chunk, mask, scale, start, soft_cap
            )

    @staticmethod
    def _decode(
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: TorchPagedMetadata,
        scale: float,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        mask = md.decode_mask
        assert mask is not None
        block_tables = md.layout.decode_block_tables
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        kv_len = mask.shape[-1]
        # [B, kv_len, Hkv, D]: each request's blocks side by side.
        keys, values = gather_blocks(kv_cache, block_tables.flatten(), query.dtype)
        keys = keys.view(num_seqs, kv_len, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(num_seqs, kv_len, num_kv_heads, head_dim).transpose(1, 2)
        # The query heads sharing a KV head become that head's query rows: [B, Hkv, G, D].
        grouped = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if soft_cap is not None:
            out = attend_math(grouped, keys, values, mask, scale, soft_cap)
        else:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
        mask: torch.Tensor | None,
        scale: float,
        start: int = 0,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """One chunk's attention; ``mask`` covers the keys from position ``start`` on."""
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        # [1, H, n, D]: with a batch dimension SDPA takes PyTorch's fused CPU kernel;
        # 3-D inputs fall back to the unfused math path, many times slower in bf16.
        query_hnd = query.transpose(0, 1)[None]
        if mask is None:
            # The whole sequence is in this chunk: attend to the fresh K/V directly, as
            # the pool holds them (rounded, when it is narrower than the activations), so
            # a prompt computes the same whether or not it is split into chunks.
            if kv_cache.dtype != query.dtype:
                key = key.to(kv_cache.dtype).to(query.dtype)
                value = value.to(kv_cache.dtype).to(query.dtype)
            keys, values = key.transpose(0, 1)[None], value.transpose(0, 1)[None]
        else:
            # Only the blocks the chunk's window reaches (all of them without a window).
            table = chunk.block_table[start // kv_cache.shape[2] :]
            gathered = gather_blocks(kv_cache, table, query.dtype)
            length = chunk.seq_len - start
            keys, values = (t.view(-1, num_kv_heads, head_dim)[:length] for t in gathered)
            keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if soft_cap is not None:
            out = attend_math(query_hnd, keys, values, mask, scale, soft_cap)
        else:
            out = F.scaled_dot_product_attention(
                query_hnd,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
        return out[0].transpose(0, 1)


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``block_ids`` (1-D), each ``[len(block_ids), block_size, Hkv, D]``.

    ``index_select`` over whole blocks copies each block as one contiguous
    run; advanced indexing would walk it element by element (~2x slower).
    ``dtype``: the activations' dtype, when the pool's is narrower.
    """
    num_blocks = kv_cache.shape[1]
    rows = kv_cache.view(2, num_blocks, -1)  # a block's slots, heads and dims are contiguous
    shape = (block_ids.shape[0], *kv_cache.shape[2:])
    keys = torch.index_select(rows[0], 0, block_ids).view(shape)
    values = torch.index_select(rows[1], 0, block_ids).view(shape)
    if dtype is not None and dtype != kv_cache.dtype:
        return keys.to(dtype), values.to(dtype)
    return keys, values
