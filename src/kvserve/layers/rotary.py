"""Rotary position embeddings (rotate-half layout) with optional frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.kernels import NativeOps


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32, scaled as the config asks."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band
        # between interpolated smoothly (Llama 3.1's context extension).
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        original_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = original_len / low_freq_factor
        high_freq_wavelen = original_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(f"rope_scaling type {rope_type!r} is not supported (linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """cos/sin of positions ``0 .. max_position - 1``, tabulated as far as steps have reached.

    The model looks up a step's positions once and every layer reuses them. The
    table starts at ``INITIAL_POSITIONS`` rows and doubles when a step goes past
    it: a model file may declare a context of millions of tokens (tens of GiB of
    table) that no request ever uses.
    """

    INITIAL_POSITIONS = 4096

    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.max_position = max_position
        self.dtype = dtype
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        table = self._table(0, min(max_position, self.INITIAL_POSITIONS), torch.device("cpu"))
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _table(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Rows ``start .. stop - 1``: ``[stop - start, 2, D]``."""
        positions = torch.arange(start, stop, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [positions, head_dim]
        return torch.stack([angles.cos(), angles.sin()], dim=1).to(device, self.dtype)

    def tabulate_all(self) -> None:
        """Tabulate every position now, so that no lookup reads ``positions`` back to the
        host (a step recorded as a CUDA graph must not)."""
        have = self.cos_sin_cache.shape[0]
        if have < self.max_position:
            extra = self._table(have, self.max_position, self.cos_sin_cache.device)
            self.cos_sin_cache = torch.cat([self.cos_sin_cache, extra])

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions ``[T]`` → ``[T, 2, D]``: each position's cosines, then its sines."""
        if positions.numel() and self.cos_sin_cache.shape[0] < self.max_position:
            needed = int(positions.max()) + 1
            have = self.cos_sin_cache.shape[0]
            if needed > have:
                if needed > self.max_position:
                    raise IndexError(
                        f"position {needed - 1} is past the model's {self.max_position} positions"
                    )
                grown = min(self.max_position, max(needed, 2 * have))
                extra = self._table(have, grown, self.cos_sin_cache.device)
                self.cos_sin_cache = torch.cat([self.cos_sin_cache, extra])
        return self.cos_sin_cache[positions]


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` (rotate-half layout) by the angles of its positions.

    cos_sin: ``[T, 2, D]`` from :class:`RotaryEmbedding`.
    """
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]  # [T, 1, D]: broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RotaryQK(nn.Module):
    """Rotates the q and k heads at the front of each fused ``[q | k | v]`` projection row."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_qk_heads = num_heads + num_kv_heads
        self.head_dim = head_dim
        # Set by the worker when a C kernel rotates the rows in place (float32 on CPU).
        self.native: NativeOps | None = None

    def forward(
        self, qkv_flat: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv_flat ``[T, (Hq + 2 Hkv) D]`` → rotated q ``[T, Hq, D]`` and k ``[T, Hkv, D]``."""
        num_tokens = qkv_flat.shape[0]
        if self.native is not None and qkv_flat.is_contiguous():
            self.native.rotary_(qkv_flat, cos_sin, self.num_qk_heads, self.head_dim)
            qk = qkv_flat.view(num_tokens, -1, self.head_dim)[:, : self.num_qk_heads]
        else:
            heads = qkv_flat.view(num_tokens, -1, self.head_dim)
            # One rotation for the q and k heads together: half the elementwise ops.
            qk = apply_rotary(heads[:, : self.num_qk_heads], cos_sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :]
