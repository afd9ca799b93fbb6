"""Paged attention in plain PyTorch: runs on any device, the default on CPU.

Decode queries of all requests are handled together: their pages are gathered
into one ``[batch, kv_len]`` rectangle (the null block pads short tables; a
length mask hides the padding) and attended in one call. Grouped-query heads
ride along as extra query rows, so K/V are never repeated per query head.

Prefill chunks are attended one request at a time; a step holds few of them,
and each is a large matrix product on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, write_kv_cache
from kvserve.attention.cascade import cascade_decode, common_prefix_len
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk


@dataclass(frozen=True)
class TorchPagedMetadata(AttentionMetadata):
    """The shared layout plus the masks this backend attends with.

    decode_mask: ``[num_decode_tokens, 1, 1, num_blocks * block_size]``
        additive mask in the activations' dtype: 0 for the slots that hold the
        request's keys, -inf for padding; None when decodes are not attended here.
    chunk_masks: per prefill chunk, ``[query_len, seq_len]`` additive mask, 0
        where query i may see key j (``j <= context_len + i``), -inf elsewhere;
        None for a chunk that starts at position 0 (plainly causal).
    decode_common_prefix_len: the first this-many positions of every decode
        row sit in the same blocks (a prefix-cache hit they share), so they are
        attended once for all rows (cascade); 0 when there is none worth it.
    """

    decode_mask: torch.Tensor | None = None
    chunk_masks: tuple[torch.Tensor | None, ...] = ()
    decode_common_prefix_len: int = 0


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive mask attention uses: 0 or -inf."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _chunk_mask(chunk: PrefillChunk, dtype: torch.dtype) -> torch.Tensor | None:
    if chunk.context_len == 0:
        return None
    device = chunk.block_table.device
    query_pos = torch.arange(chunk.context_len, chunk.seq_len, device=device)
    key_pos = torch.arange(chunk.seq_len, device=device)
    return _additive(key_pos[None, :] <= query_pos[:, None], dtype)


class TorchPagedAttention(AttentionBackend):
    name = "torch_paged"

    def build_metadata(
        self, layout: AttentionMetadata, dtype: torch.dtype, decodes: bool = True
    ) -> TorchPagedMetadata:
        """Masks in ``dtype`` and the cascade decision; ``decodes=False`` skips the
        decode rows' (for a backend that attends to them itself)."""
        decode_mask = None
        prefix_len = 0
        if decodes and layout.num_decode_tokens:
            kv_slots = layout.decode_block_tables.shape[1] * layout.block_size
            slots = torch.arange(kv_slots, device=layout.decode_seq_lens.device)
            visible = slots[None, :] < layout.decode_seq_lens[:, None]
            decode_mask = _additive(visible, dtype)[:, None, None, :]
            prefix_len = common_prefix_len(
                layout.decode_block_tables, layout.decode_seq_lens, layout.block_size
            )
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(AttentionMetadata)}
        return TorchPagedMetadata(
            **fields,
            decode_mask=decode_mask,
            chunk_masks=tuple(_chunk_mask(chunk, dtype) for chunk in layout.prefills),
            decode_common_prefix_len=prefix_len,
        )

    def _own(
        self, md: AttentionMetadata, dtype: torch.dtype, decodes: bool = True
    ) -> TorchPagedMetadata:
        """``md`` as built for this backend (built here when a caller passed the bare layout)."""
        if isinstance(md, TorchPagedMetadata) and (md.decode_mask is not None or not decodes):
            return md
        return self.build_metadata(md, dtype, decodes)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        md = self._own(attn_metadata, query.dtype, decodes=attn_metadata.num_decode_tokens > 0)
        write_kv_cache(key, value, kv_cache, md.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = md.num_decode_tokens
        if num_decodes and md.decode_common_prefix_len:
            output[:num_decodes] = cascade_decode(query[:num_decodes], kv_cache, md, scale)
        elif num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], kv_cache, md, scale)
        self.prefill_into(output, query, key, value, kv_cache, md, scale)
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
        md = self._own(attn_metadata, query.dtype, decodes=False)
        for chunk, mask in zip(md.prefills, md.chunk_masks, strict=True):
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            output[rows] = self._prefill(
                query[rows], key[rows], value[rows], kv_cache, chunk, mask, scale
            )

    @staticmethod
    def _decode(
        query: torch.Tensor, kv_cache: torch.Tensor, md: TorchPagedMetadata, scale: float
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        assert md.decode_mask is not None
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
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
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
            attn_mask=mask,
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
