"""Precision names a config accepts, and the concrete dtype ``auto`` stands for here.

Both the weights (``ModelConfig.dtype``) and the KV pool
(``CacheConfig.kv_cache_dtype``) take these names. What ``auto`` means depends
on the machine (its CPU flags as ``KVSERVE_CPU_ISA`` leaves them, whether
kvserve's C kernels built), so it is
resolved by a function at load time and never written back into a config.
"""

from __future__ import annotations

from typing import Literal

from kvserve.cpu_isa import cpu_isa

DTypeName = Literal["auto", "float32", "bfloat16"]
DTYPE_NAMES = ("auto", "float32", "bfloat16")


def cpu_has_native_bf16() -> bool:
    """True when kvserve may use AVX512-BF16 or AMX-BF16 (the CPU has it, ``KVSERVE_CPU_ISA`` allows it)."""
    return cpu_isa().has_any("avx512_bf16", "amx_bf16")


def resolve_dtype_name(
    dtype: DTypeName, native_kernels: bool, encoder: bool = False
) -> Literal["float32", "bfloat16"]:
    """The concrete weight dtype ``auto`` stands for on this machine.

    native_kernels: kvserve's C kernels are built; they multiply bfloat16
    weights on any CPU, so bfloat16 is then the fast choice for a decoder,
    whose decode steps are bound by the weights' bytes.
    encoder: the model only ever computes whole prompts (a BERT encoder),
    bound by arithmetic rather than bytes: without bf16 units it stays
    float32, which BLAS multiplies 1.5-2x faster than the kernels widen bf16.
    """
    if dtype == "auto":
        native_bf16 = cpu_has_native_bf16()
        if encoder and not native_bf16:
            return "float32"
        return "bfloat16" if native_kernels or native_bf16 else "float32"
    return dtype
