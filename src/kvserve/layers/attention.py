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
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        """sliding_window: a token sees only the last this-many positions, itself
        included (None: all of them); logits_soft_cap: scores are squashed to
        ``cap * tanh(score / cap)`` (None: unchanged)."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the model runner.
        self.kv_cache = torch.empty(0)
        # Which entry of the step's AttentionMetadata.groups this layer reads (its KV cache
        # group's, whose layout carries this layer's sliding window).
        self.kv_group = 0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` → ``[T, Hq, D]``."""
        return self.backend.forward(
            query,
            key,
            value,
            self.kv_cache,
            attn_metadata.groups[self.kv_group],
            self.scale,
            self.logits_soft_cap,
        )
