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
from kvserve.attention.metadata import AttentionLayout
from kvserve.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from kvserve.kernels import NativeOps


class NativePagedAttention(AttentionBackend[TorchPagedMetadata]):
    """Decode rows through the C kernel; prefill chunks through :class:`TorchPagedAttention`,
    whose metadata (the chunks' masks only) this backend builds and reads."""

    name = "native_paged"

    def __init__(self, ops: NativeOps) -> None:
        self.ops = ops
        self.prefill = TorchPagedAttention()  # prefill chunks are PyTorch's fused attention

    def build_group(
        self, layout: AttentionLayout, dtype: torch.dtype, num_pool_blocks: int
    ) -> TorchPagedMetadata:
        """Decodes need only the layout; prefill chunks get their masks from PyTorch's side."""
        return self.prefill.build_group(layout, dtype, num_pool_blocks, decodes=False)

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
        layout = metadata.layout
        self.ops.write_cache(key, value, kv_cache, layout.slot_mapping)
        num_decodes = layout.num_decode_tokens
        decoded = None
        if num_decodes:
            decoded = self.ops.paged_decode(
                query[:num_decodes],
                kv_cache,
                layout.decode_block_tables,
                layout.decode_seq_lens,
                scale,
                layout.sliding_window,
                soft_cap,
            )
        if not layout.prefills:  # a decode-only step: every token is a decode row
            assert decoded is not None
            return decoded
        output = torch.empty_like(query)
        if decoded is not None:
            output[:num_decodes] = decoded
        self.prefill.prefill_into(output, query, key, value, kv_cache, metadata, scale, soft_cap)
        return output
