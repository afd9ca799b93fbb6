"""The attention layer as the model sees it: q, k, v in, attended values out.

The layer owns no weights. The model runner binds the layer's slice of the
paged KV pool to ``kv_cache`` after sizing the pool, and the index of the
layer's KV cache group to ``kv_group``; the backend does the work.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the model runner.
        self.kv_cache = torch.empty(0)
        # Which of the step's per-group layouts this layer reads (AttentionMetadata.groups).
        self.kv_group = 0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` → ``[T, Hq, D]``."""
        layout = attn_metadata.for_group(self.kv_group)
        return self.backend.forward(query, key, value, self.kv_cache, layout, self.scale)
