"""Attention backends behind one small interface, and the per-step metadata."""

from __future__ import annotations

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.errors import InvalidParameterError

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchPagedAttention.name: TorchPagedAttention,
}


def get_attention_backend(name: str = "torch_paged") -> AttentionBackend:
    """The attention implementation called ``name``."""
    backend = _BACKENDS.get(name)
    if backend is None:
        raise InvalidParameterError(
            "attention_backend", f"unknown backend {name!r}; known: {', '.join(_BACKENDS)}"
        )
    return backend()


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "PrefillChunk",
    "TorchPagedAttention",
    "get_attention_backend",
]
