"""Paged attention whose decode reads the KV pool in place through a C kernel.

The PyTorch backend gathers every decode row's pages into a padded rectangle
before attending; at large batches and long contexts that copy, and the
padded attention after it, cost more than the rest of the layer. The C
kernel walks each sequence's block table and reads every live K/V entry
once (see ``kernels/csrc/paged_attention.c``). Prefill chunks are large
matrix products and stay with PyTorch's fused attention.

Sliding windows and soft-capped scores are handled by the kernel too. Used
for float32 activations on CPU when the kernels are built, over a float32 or
bfloat16 pool; results match :class:`TorchPagedAttention` up to
float rounding.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.kernels import NativeOps


class NativePagedAttention(AttentionBackend):
    name = "native_paged"

    def __init__(self, ops: NativeOps) -> None:
        self.ops = ops
        self.prefill = TorchPagedAttention()  # prefill chunks are PyTorch's fused attention

    def build_metadata(self, layout: AttentionMetadata, dtype: torch.dtype) -> AttentionMetadata:
        """Decodes need only the layout; prefill chunks get their masks from PyTorch's side."""
        if not layout.prefills:
            return layout
        return self.prefill.build_metadata(layout, dtype, decodes=False)

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
        self.ops.write_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        md = attn_metadata
        num_decodes = md.num_decode_tokens
        decoded = None
        if num_decodes:
            decoded = self.ops.paged_decode(
                query[:num_decodes],
                kv_cache,
                md.decode_block_tables,
                md.decode_seq_lens,
                scale,
                sliding_window,
                soft_cap,
            )
        if not md.prefills:  # a decode-only step: every token is a decode row
            assert decoded is not None
            return decoded
        output = torch.empty_like(query)
        if decoded is not None:
            output[:num_decodes] = decoded
        self.prefill.prefill_into(
            output, query, key, value, kv_cache, md, scale, sliding_window, soft_cap
        )
        return output
