"""Cascade decode attention: a prefix shared by every decode row is attended to once.

With prefix caching, requests that start with the same system prompt hold the
same KV blocks for it. Plain paged decode gathers those blocks once per row,
so a batch of 64 rows reads the shared prefix 64 times, and the gather
dominates the step. Here the shared prefix is gathered once and attended by
all rows' queries in one matrix product; each row's own tail is attended
separately; the two partial softmaxes are then merged exactly through their
maxima and sums (the log-sum-exp trick), so the result equals attention over
the whole sequence up to rounding.

The shared part is computed in float32 (as fused kernels accumulate); inputs
and output keep the cache's dtype.
"""

from __future__ import annotations

import torch

# Decode rows sharing fewer prefix tokens than this attend in one fused pass:
# below it, gathering the shared blocks once saves less than a second pass costs.
MIN_CASCADE_PREFIX_LEN = 256


def common_prefix_len(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """Leading positions that all rows hold in the same blocks (prefix-cache sharing).

    Capped below every row's length, so each query keeps a key of its own
    past the shared part; 0 for a single row or a prefix under
    ``MIN_CASCADE_PREFIX_LEN`` tokens.
    """
    if len(block_tables) < 2:
        return 0
    same_block = (block_tables == block_tables[0]).all(dim=0)
    num_shared = (
        int(same_block.numel()) if bool(same_block.all()) else int(same_block.int().argmin())
    )
    num_shared = min(num_shared, (int(seq_lens.min()) - 1) // block_size)
    length = num_shared * block_size
    return length if length >= MIN_CASCADE_PREFIX_LEN else 0


def _partial_softmax(
    scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised ``softmax(scores) @ values`` with its row maxima and sums."""
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    return torch.matmul(weights, values), row_max, weights.sum(dim=-1, keepdim=True)


def cascade_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    decode_mask: torch.Tensor,
    prefix_len: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention when every row's first ``prefix_len`` keys sit in the same blocks.

    query: ``[B, H, D]``, one token per row; kv_cache: ``[2, num_blocks,
    block_size, Hkv, D]``; block_tables: ``[B, num_blocks]``, the rows'
    tables (null-padded); decode_mask: ``[B, 1, 1, num_blocks * block_size]``
    additive, -inf past each row's length; prefix_len: a multiple of
    ``block_size`` (see :func:`common_prefix_len`). Returns ``[B, H, D]``.
    Every row must have at least one key past the shared prefix (its own
    token), which :func:`common_prefix_len` guarantees.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    num_prefix_blocks = prefix_len // block_size
    # Query heads sharing a KV head become its rows: [B, Hkv, G, D].
    grouped = query.view(num_seqs, num_kv_heads, group, head_dim).float()

    # Shared prefix: one gather; all B * G rows of a KV head in one product.
    prefix_blocks = block_tables[0, :num_prefix_blocks]
    keys = kv_cache[0][prefix_blocks].view(prefix_len, num_kv_heads, head_dim).float()
    values = kv_cache[1][prefix_blocks].view(prefix_len, num_kv_heads, head_dim).float()
    rows = grouped.transpose(0, 1).reshape(num_kv_heads, num_seqs * group, head_dim)
    scores = torch.matmul(rows, keys.permute(1, 2, 0)) * scale  # [Hkv, B*G, P]
    out_p, max_p, sum_p = _partial_softmax(scores, values.transpose(0, 1))
    # Back to [B, Hkv, G, *].
    out_p, max_p, sum_p = (
        t.view(num_kv_heads, num_seqs, group, -1).transpose(0, 1) for t in (out_p, max_p, sum_p)
    )

    # Each row's own tail, from the prefix's end to its length, padded to the longest.
    tail_table = block_tables[:, num_prefix_blocks:]
    tail_len = decode_mask.shape[-1] - prefix_len
    tail_keys = kv_cache[0][tail_table].view(num_seqs, tail_len, num_kv_heads, head_dim).float()
    tail_values = kv_cache[1][tail_table].view(num_seqs, tail_len, num_kv_heads, head_dim).float()
    scores = torch.matmul(grouped, tail_keys.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, T]
    scores += decode_mask[..., prefix_len:].float()  # -inf past each row's length
    out_t, max_t, sum_t = _partial_softmax(scores, tail_values.transpose(1, 2))

    # softmax over prefix + tail = both parts rescaled to a common maximum.
    joint_max = torch.maximum(max_p, max_t)
    weight_p, weight_t = torch.exp(max_p - joint_max), torch.exp(max_t - joint_max)
    out = (out_p * weight_p + out_t * weight_t) / (sum_p * weight_p + sum_t * weight_t)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
