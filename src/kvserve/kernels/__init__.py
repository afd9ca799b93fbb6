"""Native CPU kernels (C, compiled for the running CPU on first use) and their wrappers."""

from __future__ import annotations

from kvserve.kernels.ops import NativeOps, WeightKind, native_ops, supports_paged_decode

__all__ = ["NativeOps", "WeightKind", "native_ops", "supports_paged_decode"]
