"""Native CPU kernels (C, compiled for the running CPU on first use) and their wrappers."""

from __future__ import annotations

from kvserve.kernels.ops import (
    DecodeLayerWeights,
    DecodeStack,
    NativeOps,
    native_ops,
    supports_paged_decode,
)

__all__ = [
    "DecodeLayerWeights",
    "DecodeStack",
    "NativeOps",
    "native_ops",
    "supports_paged_decode",
]
