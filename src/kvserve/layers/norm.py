"""RMSNorm (Llama family) and LayerNorm (GPT-2), computed in float32 whatever the weights' dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NativeOps


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        # Set by the model runner when a C kernel does the work (float32 on CPU).
        self.native: NativeOps | None = None

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` and its norm: the pre-norm residual stream's step.

        Returns ``(norm(residual + x), residual + x)``; the native kernel
        updates ``residual`` in place, so callers must use the returned one.
        """
        if self.native is not None:
            return self.native.rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2:
            return self.native.rms_norm(x, None, self.weight, self.eps)
        if x.is_cuda:
            # One fused kernel (PyTorch's fused RMSNorm, float32 inside) instead of the six
            # kernels and two dtype copies below: a decode step's CUDA graph is mostly these
            # small launches, two norms per layer and two more with q/k norms.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class LayerNorm(nn.Module):
    """``(x - mean(x)) / std(x) * weight + bias`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        # Set by the model runner when a C kernel does the work (float32 on CPU).
        self.native: NativeOps | None = None

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``, as :meth:`RMSNorm.add_and_norm`; the
        native kernel updates ``residual`` in place, so callers must use the returned one."""
        if self.native is not None:
            return self.native.add_layer_norm(
                x, residual, self.weight, self.bias, self.eps
            ), residual
        residual = residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2:
            return self.native.add_layer_norm(x, None, self.weight, self.bias, self.eps)
        normed = F.layer_norm(
            x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps
        )
        return normed.to(x.dtype)
