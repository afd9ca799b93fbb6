"""RoPE scaling of a GGUF model, as a Hugging Face ``rope_scaling`` dict.

GGUF stores RoPE scaling in two ways:

- metadata ``<arch>.rope.scaling.type`` (``none``, ``linear``, ``yarn``, ...)
  with ``.factor`` and ``.original_context_length``;
- for Llama 3.x ("llama3" scaling), no metadata at all but a tensor
  ``rope_freqs.weight`` of ``head_dim / 2`` factors: llama.cpp divides each
  RoPE frequency by its factor. The converter computed the factors from
  ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
  ``original_max_position_embeddings``; this module recovers an equivalent
  parameter set so that the model code has a single (Hugging Face) form.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_file import field_value, find_tensor
from kvserve.loader.gguf_types import GGUFFile
from kvserve.models.arch_limits import checked_int, checked_positive_float

ROPE_FREQS_TENSOR = "rope_freqs.weight"

# A factor this close to 1 (or to the largest factor) is not in the smoothed band.
_BAND_EPS = 1e-4

# Llama 3's pre-training context. Any value gives the same frequencies (see
# llama3_scaling_from_factors); this one recovers the published parameters of
# every Llama 3.x release, so the dict reads like their config.json.
_LLAMA3_ORIGINAL_CONTEXT = 8192


def rope_scaling_from_gguf(
    reader: GGUFFile,
    arch_name: str,
    head_dim: int,
    rope_theta: float,
) -> dict[str, Any] | None:
    """The ``rope_scaling`` dict for the model in ``reader``, or None without scaling."""
    prefix = f"{arch_name}.rope.scaling."
    scaling_type = field_value(reader, prefix + "type")
    original_context = field_value(reader, prefix + "original_context_length")
    if original_context is not None:
        original_context = checked_int(
            original_context,
            "max_position_embeddings",
            prefix + "original_context_length",
            prefix="GGUF metadata ",
        )
    rope_freqs = find_tensor(reader, ROPE_FREQS_TENSOR)
    if rope_freqs is not None:
        if scaling_type not in (None, "none"):
            raise ModelLoadError(
                f"GGUF has both {ROPE_FREQS_TENSOR} and rope.scaling.type {scaling_type!r}; "
                "this combination is not supported",
                field=ROPE_FREQS_TENSOR,
            )
        try:
            factors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{ROPE_FREQS_TENSOR}: {exc}", field=ROPE_FREQS_TENSOR) from exc
        return llama3_scaling_from_factors(
            factors.astype(np.float32).reshape(-1),
            head_dim,
            rope_theta,
            original_context or _LLAMA3_ORIGINAL_CONTEXT,
        )
    if scaling_type in (None, "none"):
        return None

    def positive(key: str) -> float:
        return checked_positive_float(
            field_value(reader, prefix + key), prefix + key, prefix="GGUF metadata "
        )

    factor = positive("factor")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    if scaling_type == "yarn":
        yarn: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        if original_context is not None:
            yarn["original_max_position_embeddings"] = original_context
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if prefix + gguf_key in reader.fields:
                yarn[hf_key] = positive(gguf_key)
        return yarn
    raise ModelLoadError(
        f"GGUF rope scaling type {scaling_type!r} is not supported "
        "(supported: none, linear, yarn, and llama3 via rope_freqs.weight)",
        field=prefix + "type",
    )


def llama3_factors(
    scaling: dict[str, Any], head_dim: int, rope_theta: float
) -> npt.NDArray[np.float64]:
    """The per-frequency divisors llama.cpp's converter derives from llama3 parameters."""
    wavelen = _wavelengths(head_dim, rope_theta)
    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    smooth = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
    # Long wavelengths (smooth 0) are divided by factor, short ones (smooth 1)
    # are kept, the band between interpolates the inverse linearly.
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def llama3_scaling_from_factors(
    factors: npt.NDArray[np.float32], head_dim: int, rope_theta: float, original_context: int
) -> dict[str, Any] | None:
    """Recover llama3 ``rope_scaling`` parameters from the divisors in ``rope_freqs.weight``.

    Inside the smoothed band ``1 / f = 1/factor + s (1 - 1/factor)`` with
    ``s = (L / wavelen - low) / (high - low)``, a straight line in ``1 / wavelen``.
    Its slope and intercept fix ``low`` and ``high`` for a given ``L``, and every
    ``L`` gives the same frequencies (the band edges ``L / low`` and ``L / high``
    do not move), so ``L`` is the caller's choice. At least two frequencies must
    fall inside the band (true of every Llama 3.x model); the recovered set is
    checked by recomputing the factors.
    """
    num_freqs = head_dim // 2
    if factors.shape != (num_freqs,):
        raise ModelLoadError(
            f"{ROPE_FREQS_TENSOR} has {factors.size} values, expected head_dim / 2 = {num_freqs}",
            field=ROPE_FREQS_TENSOR,
        )
    unsupported = ModelLoadError(
        f"{ROPE_FREQS_TENSOR} does not match llama3 RoPE scaling; this kind of "
        "GGUF rope scaling is not supported",
        field=ROPE_FREQS_TENSOR,
    )
    # llama3 divisors lie between 1 and factor; anything else (NaN, zero,
    # negative) is not llama3 and would only divide by zero below.
    if not (np.isfinite(factors).all() and factors.min() >= 1.0):
        raise unsupported
    factor = float(factors.max())
    if math.isclose(factor, 1.0, rel_tol=1e-6) and math.isclose(float(factors.min()), 1.0):
        return None
    wavelen = _wavelengths(head_dim, rope_theta)
    smooth = (1.0 / factors.astype(np.float64) - 1.0 / factor) / (1.0 - 1.0 / factor)
    in_band = (smooth > _BAND_EPS) & (smooth < 1.0 - _BAND_EPS)
    if int(in_band.sum()) < 2:
        raise unsupported
    try:
        slope, intercept = np.polyfit(1.0 / wavelen[in_band], smooth[in_band], 1)
    except (np.linalg.LinAlgError, ValueError) as exc:
        raise unsupported from exc
    if slope <= 0 or intercept >= 0:
        raise unsupported
    band_width = original_context / slope  # high_freq_factor - low_freq_factor
    low_freq_factor = -intercept * band_width
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low_freq_factor),
        "high_freq_factor": float(low_freq_factor + band_width),
        "original_max_position_embeddings": int(original_context),
    }
    if not np.allclose(llama3_factors(scaling, head_dim, rope_theta), factors, rtol=1e-4):
        raise unsupported
    return scaling


def _wavelengths(head_dim: int, rope_theta: float) -> npt.NDArray[np.float64]:
    # The wavelength of each rotated pair: 2π / inv_freq, inv_freq = θ^(-2i/d).
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return 2.0 * math.pi * np.power(float(rope_theta), exponents)
