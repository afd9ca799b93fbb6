"""Attention backends behind one small interface, and the per-step metadata."""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.flex import FlexAttention, FlexMetadata
from kvserve.attention.metadata import AttentionLayout, AttentionMetadata, PrefillChunk
from kvserve.attention.native_paged import NativePagedAttention
from kvserve.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from kvserve.config.model import ATTENTION_BACKENDS
from kvserve.errors import InvalidParameterError
from kvserve.kernels import native_ops, supports_paged_decode


def get_attention_backend(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_blocks_per_seq: int = 1,
) -> AttentionBackend:
    """The attention implementation called ``name`` for a model of this dtype and shape.

    ``auto`` takes FlexAttention on CUDA; on CPU the native kernels where they
    apply (float32, the kernels built, shapes they handle) and the PyTorch
    backend otherwise. max_blocks_per_seq: the most KV blocks one sequence
    holds (FlexAttention sizes its block lists by it).
    """
    if name not in ATTENTION_BACKENDS:
        raise InvalidParameterError(
            "attention_backend",
            f"unknown backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}",
        )
    if name == TorchPagedAttention.name:
        return TorchPagedAttention()
    if name == FlexAttention.name or (name == "auto" and device.type == "cuda"):
        return FlexAttention(device, max_blocks_per_seq)
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
    "AttentionBackend",
    "AttentionLayout",
    "AttentionMetadata",
    "FlexAttention",
    "FlexMetadata",
    "NativePagedAttention",
    "PrefillChunk",
    "TorchPagedAttention",
    "TorchPagedMetadata",
    "get_attention_backend",
]
