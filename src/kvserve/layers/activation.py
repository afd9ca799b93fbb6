"""The gated activations of GLU MLPs: SwiGLU (Llama) and GeGLU (Gemma)."""

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


class GeluAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` for ``[T, 2 I]`` rows holding gate then up; returns ``[T, I]``.

    GELU with the tanh approximation, transformers' ``gelu_pytorch_tanh``
    (GeGLU, Gemma). ``approximate`` and ``gated`` tell the one-call decode
    kernel which activation it walks.
    """

    approximate = "tanh"
    gated = True

    def __init__(self) -> None:
        super().__init__()
        # Set by the worker when a C kernel does it in one pass (float32 on CPU).
        self.native: NativeOps | None = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None and gate_up.dim() == 2 and gate_up.dtype == torch.float32:
            return self.native.gelu_tanh(gate_up, gated=True)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
