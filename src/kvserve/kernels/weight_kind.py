"""How the kernels store and multiply linear weights."""

from __future__ import annotations

import enum


class WeightKind(enum.IntEnum):
    """How a linear weight is stored and multiplied (``KV_WEIGHTS_*`` in kernels.h)."""

    F32 = 0
    BF16_WIDEN = 1  # bfloat16 widened to float32 as it streams: any CPU
    BF16_DOT = 2  # bfloat16 with AVX512-BF16 dot products
    QUANT = 3  # GGUF's quantized blocks: the pointer is a KvQuantWeight (quant_weight.py)
