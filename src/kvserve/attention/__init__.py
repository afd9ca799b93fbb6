"""Attention backends behind one small interface, and the per-step metadata."""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
from kvserve.attention.native_paged import NativePagedAttention
from kvserve.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from kvserve.errors import InvalidParameterError
from kvserve.kernels import native_ops, supports_paged_decode

BACKEND_NAMES = ("auto", TorchPagedAttention.name, NativePagedAttention.name)  # = config's


def get_attention_backend(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> AttentionBackend:
    """The attention implementation called ``name`` for a model of this dtype and shape.

    ``auto`` takes the native kernels where they apply (float32 on CPU, the
    kernels built, shapes they handle) and the PyTorch backend otherwise.
    """
    if name not in BACKEND_NAMES:
        raise InvalidParameterError(
            "attention_backend", f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}"
        )
    if name == TorchPagedAttention.name:
        return TorchPagedAttention()
    fits = (
        device.type == "cpu"
        and dtype == torch.float32
        and supports_paged_decode(head_dim, num_heads, num_kv_heads)
    )
    ops = native_ops() if fits else None
    if ops is not None:
        return NativePagedAttention(ops)
    if name == NativePagedAttention.name:
        raise InvalidParameterError(
            "attention_backend",
            "native_paged needs float32 on CPU and the C kernels built (see the log); "
            "use auto or torch_paged",
        )
    return TorchPagedAttention()


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "NativePagedAttention",
    "PrefillChunk",
    "TorchPagedAttention",
    "TorchPagedMetadata",
    "get_attention_backend",
]
