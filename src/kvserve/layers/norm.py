"""RMSNorm, computed in float32 whatever the weights' dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)
