"""MLP activations: the gated ones of GLU MLPs, SwiGLU (Llama) and GeGLU (Gemma), and
GELU for plain two-layer MLPs (GPT-2)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NativeOps

# Hugging Face activation names (config.json ``activation_function`` / ``hidden_act``)
# → the GELU approximation that computes them. ``gelu_new``, ``gelu_pytorch_tanh`` and
# ``gelu_fast`` are one formula, the tanh approximation, written three ways.
GELU_APPROXIMATIONS: dict[str, Literal["none", "tanh"]] = {
    "gelu": "none",
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu_fast": "tanh",
}


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


class GELU(nn.Module):
    """GELU of every element, exact (``none``, with erf) or with the tanh approximation."""

    def __init__(self, approximate: Literal["none", "tanh"] = "tanh") -> None:
        super().__init__()
        self.approximate = approximate
        # Set by the worker when a C kernel does the tanh approximation (float32 on CPU).
        self.native: NativeOps | None = None

    @classmethod
    def named(cls, name: str) -> GELU:
        """The GELU a Hugging Face activation name means (a key of ``GELU_APPROXIMATIONS``)."""
        return cls(GELU_APPROXIMATIONS[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and self.approximate == "tanh" and x.dim() == 2:
            return self.native.gelu_tanh(x, gated=False)
        return F.gelu(x, approximate=self.approximate)


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
