"""The interface every attention implementation provides."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes a step's K/V into the paged cache and attends over it.

    The KV cache of one layer is a tensor ``[2, num_blocks, block_size,
    num_kv_heads, head_dim]`` (index 0 holds K, 1 holds V). Backends may
    differ in speed, never in results beyond floating-point rounding.
    """

    name: str

    def build_metadata(self, layout: AttentionMetadata, dtype: torch.dtype) -> AttentionMetadata:
        """What this backend needs for a step, built once and shared by every layer.

        layout: the flat batch's shared layout; dtype: the activations'. The
        default needs nothing more than the layout.
        """
        return layout

    @abstractmethod
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
        """Attention for one layer.

        query: ``[num_tokens, num_heads, head_dim]``; key, value:
        ``[num_tokens, num_kv_heads, head_dim]``. Returns ``[num_tokens,
        num_heads, head_dim]``. Each token attends causally to its own
        request's tokens only; with ``sliding_window``, to the last
        ``sliding_window`` of them (itself included): a query at position p
        sees keys at ``p - sliding_window < k <= p``, and the block-table
        entries wholly before that may hold the null block. ``soft_cap``:
        scaled scores become ``soft_cap * tanh(score / soft_cap)`` before the
        mask and the softmax (Gemma 2).
        """


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store K/V of the flat batch at their slots: ``kv_cache[:, slot] = (k, v)``.

    A pool narrower than the activations (bfloat16 under float32) stores them rounded.
    """
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    pool_dtype = kv_cache.dtype
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(pool_dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(pool_dtype))
