"""Paged attention in plain PyTorch: runs on any device, the default on CPU.

Decode queries of all requests are handled together: their pages are gathered
into one ``[batch, kv_len]`` rectangle (the null block pads short tables; a
length mask hides the padding) and attended in one call. Grouped-query heads
ride along as extra query rows, so K/V are never repeated per query head.

Prefill chunks are attended one request at a time; a step holds few of them,
and each is a large matrix product on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, write_kv_cache
from kvserve.attention.cascade import cascade_decode
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk


class TorchPagedAttention(AttentionBackend):
    name = "torch_paged"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = attn_metadata.num_decode_tokens
        if num_decodes and attn_metadata.decode_common_prefix_len:
            output[:num_decodes] = cascade_decode(
                query[:num_decodes], kv_cache, attn_metadata, scale
            )
        elif num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, attn_metadata, scale)
        self.prefill_into(output, query, key, value, kv_cache, attn_metadata, scale)
        return output

    def prefill_into(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> None:
        """Attend each prefill chunk and write it to its rows of ``output``."""
        for chunk in attn_metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            output[rows] = self._prefill(
                query[rows], key[rows], value[rows], kv_cache, chunk, scale
            )

    @staticmethod
    def _decode(
        query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        kv_len = md.decode_mask.shape[-1]
        # [B, kv_len, Hkv, D]: each request's blocks side by side.
        keys, values = gather_blocks(kv_cache, md.decode_block_tables.flatten(), query.dtype)
        keys = keys.view(num_seqs, kv_len, num_kv_heads, head_dim)
        values = values.view(num_seqs, kv_len, num_kv_heads, head_dim)
        # The query heads sharing a KV head become that head's query rows: [B, Hkv, G, D].
        grouped = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=md.decode_mask,
            scale=scale,
        )
        return out.reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        # [1, H, n, D]: with a batch dimension SDPA takes PyTorch's fused CPU kernel;
        # 3-D inputs fall back to the unfused math path, many times slower in bf16.
        query_hnd = query.transpose(0, 1)[None]
        if chunk.mask is None:
            # The whole sequence is in this chunk: attend to the fresh K/V directly, as
            # the pool holds them (rounded, when it is narrower than the activations), so
            # a prompt computes the same whether or not it is split into chunks.
            if kv_cache.dtype != query.dtype:
                key = key.to(kv_cache.dtype).to(query.dtype)
                value = value.to(kv_cache.dtype).to(query.dtype)
            out = F.scaled_dot_product_attention(
                query_hnd,
                key.transpose(0, 1)[None],
                value.transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1)
        seq_len = chunk.seq_len
        keys, values = gather_blocks(kv_cache, chunk.block_table, query.dtype)
        keys = keys.view(-1, num_kv_heads, head_dim)[:seq_len]
        values = values.view(-1, num_kv_heads, head_dim)[:seq_len]
        out = F.scaled_dot_product_attention(
            query_hnd,
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=chunk.mask,
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
