"""Paged attention whose decode reads the KV pool in place through a C kernel.

The PyTorch backend gathers every decode row's pages into a padded rectangle
before attending; at large batches and long contexts that copy, and the
padded attention after it, cost more than the rest of the layer. The C
kernel walks each sequence's block table and reads every live K/V entry
once (see ``kernels/csrc/paged_attention.c``). Prefill chunks are large
matrix products and stay with PyTorch's fused attention.

Used for float32 caches on CPU when the kernels are built; results match
:class:`TorchPagedAttention` up to float rounding.
"""

from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.kernels import NativeOps


class NativePagedAttention(TorchPagedAttention):
    name = "native_paged"

    def __init__(self, ops: NativeOps) -> None:
        self.ops = ops

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.ops.write_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        num_decodes = attn_metadata.num_decode_tokens
        decoded = self.ops.paged_decode(
            query[:num_decodes],
            kv_cache,
            attn_metadata.decode_block_tables,
            attn_metadata.decode_seq_lens,
            scale,
        )
        if not attn_metadata.prefills:
            return decoded
        output = torch.empty_like(query)
        output[:num_decodes] = decoded
        self.prefill_into(output, query, key, value, kv_cache, attn_metadata, scale)
        return output
