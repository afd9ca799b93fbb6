"""The gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NativeOps


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``[T, 2 I]`` rows holding gate then up; returns ``[T, I]``."""

    def __init__(self) -> None:
        super().__init__()
        # Set by the worker when a C kernel does it in one pass (float32 on CPU).
        self.native: NativeOps | None = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None and gate_up.dim() == 2:
            return self.native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
