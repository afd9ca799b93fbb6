"""Quantize a checkpoint's linear weights and token embeddings as they load (``--quantization``).

``q8_0``, ``q4_0`` and ``q4_k`` turn the float weights of any checkpoint (a
Hugging Face folder or a GGUF file) into GGUF's blocks, which the C kernels
multiply as they are. Each row is rounded to nearest, block by block (no
importance matrix). Only the matrices that land in a projection (q/k/v/o,
gate/up/down, GPT-2's c_attn/c_proj/c_fc, an untied LM head) or the token
embeddings are quantized; norms, biases and position embeddings keep their
floats, since they are small and their precision matters most.

A quantized tensor is always ``[out_features, in_features]``: GPT-2's Conv1D
weights, stored ``[in, out]``, are transposed before their rows are cut into
blocks. Rows are whole blocks, so a row width that is not a multiple of the
format's block (Q4_K's 256: SmolLM2's 576-wide projections) is quantized to
Q8_0 instead, with a note in the log, as llama.cpp's quantizer does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.models.arch_config import ArchConfig

logger = logging.getLogger(__name__)

# The ``quantization`` values that quantize at load, and the GGUF type of each.
QUANTIZE_AT_LOAD: dict[str, GGMLQuantizationType] = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_k": GGMLQuantizationType.Q4_K,
}
# What a tensor whose rows do not split into the chosen format's blocks gets instead.
FALLBACK_TYPE = GGMLQuantizationType.Q8_0

# The language model's decoder layers, under a Llama-style or GPT-2 prefix (vision
# towers and projectors of multimodal checkpoints do not match).
_DECODER = r"^(?:model\.|model\.language_model\.|language_model\.model\.|transformer\.)?"
_PROJECTION = re.compile(
    _DECODER + r"layers\.\d+\.(?:self_attn|mlp)\.(?:q|k|v|o|gate|up|down)_proj\.weight$"
)
# GPT-2's projections: Hugging Face Conv1D weights, stored [in, out].
_CONV1D = re.compile(
    _DECODER + r"h\.\d+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$"
)
# A BERT encoder's projections (attention's query, key, value and output, the MLP's two).
_ENCODER_PROJECTION = re.compile(
    r"^(?:bert\.)?encoder\.layer\.\d+\."
    r"(?:attention\.self\.(?:query|key|value)|attention\.output\.dense|intermediate\.dense"
    r"|output\.dense)\.weight$"
)
_EMBEDDING = re.compile(_DECODER + r"(?:embed_tokens|wte)\.weight$")
_LM_HEAD = re.compile(r"^(?:language_model\.)?lm_head\.weight$")

CheckpointValue = torch.Tensor | QuantizedTensor


def quantize_tensor(weight: torch.Tensor, qname: str) -> QuantizedTensor:
    """``weight`` ``[rows, K]`` (any float dtype) in ``qname``'s blocks, rounded to nearest.

    qname: ``q8_0``, ``q4_0`` or ``q4_k``. Rows of a width that is not a
    multiple of the format's block are quantized to Q8_0 (logged); a width
    that Q8_0's 32 does not divide either raises ValueError.
    """
    qtype = QUANTIZE_AT_LOAD.get(qname)
    if qtype is None:
        raise ValueError(f"quantization must be one of {tuple(QUANTIZE_AT_LOAD)}, got {qname!r}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"only float matrices [rows, K] are quantized, not {weight.dtype} {tuple(weight.shape)}"
        )
    rows, in_features = weight.shape
    qtype = quantized_type(qname, in_features)
    if qtype != QUANTIZE_AT_LOAD[qname]:
        logger.info(
            "rows of %d values are not whole %s blocks of %d: quantized to %s instead",
            in_features,
            QUANTIZE_AT_LOAD[qname].name,
            GGML_QUANT_SIZES[QUANTIZE_AT_LOAD[qname]][0],
            qtype.name,
        )
    if in_features % GGML_QUANT_SIZES[qtype][0]:
        raise ValueError(
            f"rows of {in_features} values are not whole {qtype.name} blocks of "
            f"{GGML_QUANT_SIZES[qtype][0]}: such a tensor cannot be quantized"
        )
    values = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if qtype == GGMLQuantizationType.Q4_K:
        data = _quantize_q4_k(values)
    else:
        from gguf.quants import quantize

        data = torch.from_numpy(np.ascontiguousarray(quantize(values.numpy(), qtype)))
    return QuantizedTensor(qtype, rows, in_features, data.view(rows, -1))


def quantized_type(qname: str, in_features: int) -> GGMLQuantizationType:
    """The type rows of ``in_features`` values get for ``quantization=qname``: its own, or
    :data:`FALLBACK_TYPE` where its blocks do not divide the rows."""
    qtype = QUANTIZE_AT_LOAD[qname]
    return qtype if in_features % GGML_QUANT_SIZES[qtype][0] == 0 else FALLBACK_TYPE


def _quantize_q4_k(values: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks from the C quantizer (gguf's numpy code has none for Q4_K)."""
    try:
        from kvserve.kernels.build import load_library
        from kvserve.kernels.quant_k_ops import (  # type: ignore[import-not-found,unused-ignore]
            quantize_q4_k,
        )
    except ImportError as exc:
        raise ValueError(
            "quantization 'q4_k' needs kvserve's Q4_K quantizer, which this build lacks; "
            "use 'q8_0' or 'q4_0'"
        ) from exc
    lib = load_library()
    if lib is None:
        raise ValueError(
            "quantization 'q4_k' needs kvserve's C kernels, which are off or do not build "
            "here; use 'q8_0' or 'q4_0'"
        )
    data: torch.Tensor = quantize_q4_k(lib, values)
    return data


def quantized_kind(name: str, arch: ArchConfig) -> str | None:
    """Why checkpoint tensor ``name`` is quantized at load (``projection``, ``conv1d``,
    ``embedding``), or None for a tensor that keeps its floats."""
    if _PROJECTION.match(name) or _ENCODER_PROJECTION.match(name):
        return "projection"
    if _CONV1D.match(name):
        return "conv1d"
    if _EMBEDDING.match(name):
        return "embedding"
    # A tied checkpoint's stored head is never loaded (the embedding is): not worth quantizing.
    if _LM_HEAD.match(name) and not arch.tie_word_embeddings:
        return "projection"
    return None


def quantize_weights(
    weights: Iterable[tuple[str, CheckpointValue]], qname: str, arch: ArchConfig
) -> Iterator[tuple[str, CheckpointValue]]:
    """The checkpoint's ``(name, tensor)`` pairs with the projection weights and token
    embeddings quantized to ``qname``, one tensor at a time; the rest pass unchanged.

    A tensor already quantized (a GGUF file's) keeps its blocks when they are
    of the requested type and is re-quantized from its values otherwise.
    """
    if qname not in QUANTIZE_AT_LOAD:
        raise ValueError(f"quantization must be one of {tuple(QUANTIZE_AT_LOAD)}, got {qname!r}")
    for name, tensor in weights:
        kind = quantized_kind(name, arch)
        if kind is None:
            yield name, tensor
            continue
        if isinstance(tensor, QuantizedTensor):
            # Already [out, in] whatever the source's layout (see models/weight_loader.py).
            if tensor.qtype == quantized_type(qname, tensor.in_features):
                yield name, tensor
                continue
            values = tensor.dequantize()
        else:
            values = tensor.t() if kind == "conv1d" and tensor.dim() == 2 else tensor
        yield name, quantize_tensor(values, qname)
