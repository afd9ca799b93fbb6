"""Quantizing float weights into GGUF's Q4_K blocks at load (``--quantization q4_k``).

A model read from safetensors (or a bf16 GGUF file) can be served with its
linear weights quantized to Q4_K, the type most Q4_K_M files hold: each row
of 256 values becomes one 144-byte block, read by the same kernels as a
Q4_K GGUF file's (``kernels/csrc/quant_k.c``), about 3.5 times fewer bytes
per decode step than bfloat16. The result is a segment for
:class:`kvserve.kernels.quant_weight.QuantWeight`.
"""

from __future__ import annotations

import ctypes

import torch

Q4_K_BLOCK_VALUES = 256
Q4_K_BLOCK_BYTES = 144  # KV_Q4_K_BLOCK_BYTES in kernels/csrc/quant_k.h


def quantize_q4_k(
    lib: ctypes.CDLL, x: torch.Tensor, num_threads: int | None = None
) -> torch.Tensor:
    """Quantize float32 ``x`` ``[rows, K]`` into uint8 ``[rows, K // 256 * 144]`` Q4_K blocks.

    lib: the kernels (``kvserve.kernels.build.load_library()``). K must be a
    multiple of 256 and every value finite. num_threads: default PyTorch's.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        described = f"{x.dtype} with {x.dim()} dims" if isinstance(x, torch.Tensor) else type(x)
        raise ValueError(f"x: a float32 [rows, K] tensor is quantized to Q4_K, not {described}")
    if x.device.type != "cpu":
        raise ValueError(f"x: Q4_K quantization runs on CPU tensors, not {x.device}")
    rows, in_features = x.shape
    if in_features == 0 or in_features % Q4_K_BLOCK_VALUES:
        raise ValueError(
            f"x: Q4_K rows hold whole blocks of {Q4_K_BLOCK_VALUES} values; K={in_features} is not"
        )
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x: Q4_K quantization needs finite values; this weight has inf or NaN")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"num_threads: at least 1, not {threads}")
    x = x.contiguous()
    out = torch.empty(rows, in_features // Q4_K_BLOCK_VALUES * Q4_K_BLOCK_BYTES, dtype=torch.uint8)
    quantize = lib.kv_quantize_rows_q4_k
    quantize.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    quantize.restype = ctypes.c_int64
    if rows:
        written = quantize(x.data_ptr(), rows, in_features, out.data_ptr(), threads)
        if written != out.numel():
            raise RuntimeError(f"the Q4_K quantizer wrote {written} bytes, not {out.numel()}")
    return out
