"""Weights of a GGUF file, renamed to Hugging Face names: dequantized, or kept quantized.

Each tensor is dequantized from the memory-mapped file, reshaped to PyTorch's
``(out_features, in_features)`` layout and yielded on its own, so at most one
dequantized tensor exists besides the model. Asked to keep them
(``keep_quantized``), the matrices of a type the kernels multiply
(``QUANT_TYPES``) come as :class:`~kvserve.kernels.quant_weight.QuantizedTensor`
instead: a view of the file's blocks, which is already the kernels' layout;
whoever cannot take one (an embedding, a transposed target) dequantizes it.

llama.cpp's converter reorders the rows of ``attn_q``/``attn_k`` for the
``llama`` architecture: Hugging Face's RoPE rotates the two halves of each head
(``rotate_half``), llama.cpp rotates adjacent pairs, so each head's rows are
interleaved from ``[first half | second half]`` to ``[a0 b0 a1 b1 ...]``.
We undo that here so the model code sees Hugging Face weights whatever the
source (a quantized tensor's rows are reordered whole, its blocks untouched). Qwen2/Qwen3 and Gemma GGUFs use the rotate-half layout and are stored
as is.

Gemma's norms multiply by ``1 + w``; llama.cpp's converter stores ``1 + w``,
Hugging Face checkpoints ``w``. The 1 is taken off here (as transformers does
when it reads a Gemma GGUF), so both sources reach the model in one form.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, overload

import gguf
import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.kernels.file_pages import drop_file_pages
from kvserve.kernels.quant_weight import QUANT_TYPES, QuantizedTensor
from kvserve.loader.gguf_config import gguf_architecture
from kvserve.loader.gguf_file import open_gguf
from kvserve.loader.gguf_rope import ROPE_FREQS_TENSOR
from kvserve.loader.gguf_types import GGUFTensor
from kvserve.models.arch_config import ArchConfig

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF per-layer tensor stem → Hugging Face module path inside model.layers.{i}.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma names its norms after where they sit: ``ffn_norm`` is the one before the MLP.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# Tensors whose information load_arch_config has already turned into config.
_CONSUMED_BY_CONFIG = frozenset({ROPE_FREQS_TENSOR})


def hf_tensor_name(gguf_name: str, num_layers: int, arch_name: str = "llama") -> str:
    """The Hugging Face name of GGUF tensor ``gguf_name`` in an ``arch_name`` file; unknown names raise."""
    global_name = _GLOBAL_NAMES.get(gguf_name)
    if global_name is not None:
        return global_name
    match = _LAYER_TENSOR.match(gguf_name)
    if match is not None:
        layer, stem, kind = int(match.group(1)), match.group(2), match.group(3)
        names = _GEMMA_LAYER_NAMES if arch_name in _GEMMA_ARCHITECTURES else _LAYER_NAMES
        module = names.get(stem)
        if module is not None and layer < num_layers:
            return f"model.layers.{layer}.{module}.{kind}"
    raise ModelLoadError(
        f"GGUF tensor {gguf_name!r} is not part of any supported architecture", field=gguf_name
    )


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of a q/k projection (weight or bias).

    weight: (num_heads * head_dim, ...) with row ``h*D + 2*i + j`` holding
    Hugging Face row ``h*D + j*D/2 + i`` (i < D/2, j ∈ {0, 1}); returns the
    Hugging Face order, same shape.
    """
    num_rows = weight.shape[0]
    if num_rows % (2 * num_heads) != 0:
        raise ModelLoadError(f"{num_rows} q/k rows cannot be split into {num_heads} RoPE heads")
    half_head_dim = num_rows // num_heads // 2
    rest = weight.shape[1:]
    by_pair = weight.reshape(num_heads, half_head_dim, 2, *rest)
    return by_pair.transpose(1, 2).reshape(weight.shape).contiguous()


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in PyTorch layout, owning its memory.

    The reader has checked that the tensor's bytes hold whole blocks of its
    shape, so the result has ``tensor.array_shape`` (ggml lists dimensions
    fastest-first, PyTorch slowest-first: ``(out_features, in_features)``).
    """
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape(tensor.array_shape)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
            "cannot be dequantized",
            field=tensor.name,
        ) from exc
    except ValueError as exc:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} is malformed: {exc}", field=tensor.name
        ) from exc
    # F32 tensors come back as a read-only view of the mmap; copy those (and any
    # non-float32 result) so the caller gets an ordinary writable tensor.
    if values.dtype != np.float32 or not values.flags.writeable:
        values = values.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(values))


def quantized_tensor(tensor: GGUFTensor) -> QuantizedTensor | None:
    """A matrix of a type the kernels multiply, as a view of the file's blocks; else None."""
    if tensor.tensor_type not in QUANT_TYPES or len(tensor.shape) != 2:
        return None
    with warnings.catch_warnings():
        # The mapping is read-only and so is the view: the kernels only read their weights.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        data = torch.from_numpy(tensor.data)
    rows, in_features = tensor.array_shape
    try:
        return QuantizedTensor(tensor.tensor_type, rows, in_features, data)
    except ValueError as exc:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} is malformed: {exc}", field=tensor.name
        ) from exc


@overload
def iter_gguf_weights(
    path: Path, arch: ArchConfig, keep_quantized: Literal[False] = False
) -> Iterator[tuple[str, torch.Tensor]]: ...


@overload
def iter_gguf_weights(
    path: Path, arch: ArchConfig, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]: ...


def iter_gguf_weights(
    path: Path, arch: ArchConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield ``(hf_name, tensor)`` for every weight in the GGUF file, one at a time.

    Tensors are float32, except with ``keep_quantized`` the matrices of a type in
    ``QUANT_TYPES``, which are :class:`QuantizedTensor`.
    """
    reader = open_gguf(path)
    arch_name = gguf_architecture(reader)
    if arch_name != arch.architecture:
        raise ModelLoadError(
            f"{path} is a {arch_name!r} GGUF but the config says {arch.architecture!r}"
        )
    # Only the llama converter permutes q/k (see the module docstring).
    rope_heads = (
        {"attn_q": arch.num_attention_heads, "attn_k": arch.num_key_value_heads}
        if arch_name == "llama"
        else {}
    )
    for tensor in reader.tensors:
        if tensor.name in _CONSUMED_BY_CONFIG:
            continue
        name = hf_tensor_name(tensor.name, arch.num_hidden_layers, arch_name)
        quantized = quantized_tensor(tensor) if keep_quantized else None
        stem = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        num_heads = rope_heads.get(stem)
        if quantized is not None:
            if num_heads is not None:
                order = _rope_row_order(quantized.rows, num_heads, tensor.name)
                reordered = quantized.take_rows(order)
                # The reordered copy is what the model keeps: the file's pages read to
                # make it would otherwise stay resident beside it.
                drop_file_pages(quantized.data)
                quantized = reordered
            yield name, quantized
            continue
        weight = dequantize_tensor(tensor)
        if arch_name in _GEMMA_ARCHITECTURES and tensor.name.endswith("norm.weight"):
            weight -= 1.0  # stored as 1 + w (see the module docstring)
        if num_heads is not None:
            weight = _unpermuted(weight, num_heads, tensor.name)
        yield name, weight


def _unpermuted(weight: torch.Tensor, num_heads: int, name: str) -> torch.Tensor:
    try:
        return unpermute_rope_rows(weight, num_heads)
    except ModelLoadError as exc:
        raise ModelLoadError(f"GGUF tensor {name!r}: {exc.message}", field=name) from exc


def _rope_row_order(num_rows: int, num_heads: int, name: str) -> torch.Tensor:
    """The file's row index of each Hugging Face row of a q/k projection."""
    return _unpermuted(torch.arange(num_rows), num_heads, name)
