"""Precision names a config accepts, and the concrete dtype ``auto`` stands for here.

Both the weights (``ModelConfig.dtype``) and the KV pool
(``CacheConfig.kv_cache_dtype``) take these names. What ``auto`` means depends
on the machine (its CPU flags, whether kvserve's C kernels built), so it is
resolved by a function at load time and never written back into a config.
"""

from __future__ import annotations

import functools
from typing import Literal

DTypeName = Literal["auto", "float32", "bfloat16"]
DTYPE_NAMES = ("auto", "float32", "bfloat16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX-BF16 (Linux /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype_name(dtype: DTypeName, native_kernels: bool) -> Literal["float32", "bfloat16"]:
    """The concrete weight dtype ``auto`` stands for on this machine.

    native_kernels: kvserve's C kernels are built; they multiply bfloat16
    weights on any CPU, so bfloat16 is then the fast choice everywhere.
    """
    if dtype == "auto":
        return "bfloat16" if native_kernels or cpu_has_native_bf16() else "float32"
    return dtype
