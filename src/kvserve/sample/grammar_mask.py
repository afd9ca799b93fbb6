"""Apply the token bitmasks of grammar-constrained rows to the logits, in one batched op.

A bitmask row holds one bit per token (bit ``t % 32`` of int32 word ``t // 32``,
1 = allowed), as llguidance writes it. Disallowed tokens get ``-inf``; allowed
ones keep their logit exactly (``+ 0.0``), and rows without a grammar are not
touched, so they sample exactly what they would alone.
"""

from __future__ import annotations

import torch

# Byte value -> the additive mask of its 8 tokens: [256, 8] float32, 0 or -inf.
_BYTE_TO_BIAS = torch.where(
    ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)


def apply_token_bitmask(
    logits_NV: torch.Tensor, bitmask_RW: torch.Tensor, rows_R: torch.Tensor
) -> None:
    """Mask rows ``rows_R`` [R] long of ``logits_NV`` [N, V] in place by ``bitmask_RW`` [R, W] int32.

    Tokens past ``32 * W`` (if the logits are wider) are disallowed.
    """
    num_rows, vocab = bitmask_RW.shape[0], logits_NV.shape[1]
    # Little-endian bytes of each word: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7.
    bytes_RB = bitmask_RW.contiguous().view(torch.uint8).to(logits_NV.device, torch.int32)
    bias_RT = torch.nn.functional.embedding(
        bytes_RB, _BYTE_TO_BIAS.to(logits_NV.device, logits_NV.dtype)
    )
    bias_RT = bias_RT.view(num_rows, -1)
    if bias_RT.shape[1] >= vocab:
        bias_RV = bias_RT[:, :vocab]
    else:
        pad = bias_RT.new_full((num_rows, vocab - bias_RT.shape[1]), float("-inf"))
        bias_RV = torch.cat([bias_RT, pad], dim=1)
    logits_NV.index_add_(0, rows_R, bias_RV)
