"""Attention with soft-capped scores, written out.

Gemma 2 squashes every scaled score through ``cap * tanh(score / cap)``
before the softmax. PyTorch's fused attention never exposes the scores, so
the layers that cap them attend here, in float32.
"""

from __future__ import annotations

import torch


def attend_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    """Soft-capped attention, written out (in float32).

    query: ``[..., Hq, n, D]``; key, value: ``[..., Hkv, S, D]`` with Hq a
    multiple of Hkv (query head h reads KV head h // (Hq / Hkv)); mask: additive,
    broadcastable to ``[..., Hq, n, S]``, or None for causal over n == S.
    Returns ``[..., Hq, n, D]`` in the query's dtype.
    """
    *batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[-3], key.shape[-2]
    group = num_heads // num_kv_heads
    grouped = query.float().reshape(*batch, num_kv_heads, group, num_queries, head_dim)
    keys, values = key.float().unsqueeze(-3), value.float().unsqueeze(-3)  # [..., Hkv, 1, S, D]
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * scale  # [..., Hkv, G, n, S]
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.reshape(*batch, num_heads, num_queries, num_keys)
    if mask is None:
        causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + mask.float()
    weights = torch.softmax(scores, dim=-1).reshape(
        *batch, num_kv_heads, group, num_queries, num_keys
    )
    out = torch.matmul(weights, values)
    return out.reshape(*batch, num_heads, num_queries, head_dim).to(query.dtype)
