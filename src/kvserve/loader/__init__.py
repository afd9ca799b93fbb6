"""Find a model and read it: config, weights and tokenizer, from HF folders or GGUF files.

Typical use::

    source = resolve_model("smollm2-135m-instruct")   # alias, path or hub id
    arch = load_arch_config(source)
    model = build_model(arch)                         # e.g. on the meta device
    for name, tensor in iter_weights(source, arch):   # one tensor at a time
        copy_into_parameter(model, name, tensor)
    tokenizer = load_tokenizer(source)

A model runner passes the weights through :class:`CachedWeights` instead,
which hands GGUF weights over already dequantized and in the model's dtype
from the converted-model cache (:mod:`kvserve.loader.model_cache`; config and
tokenizer come from there too) and fills the cache on a first load; or, with
``keep_quantized`` (``quantization="auto"`` on the CPU), hands the file's
quantized matrices over in their blocks
(:class:`~kvserve.kernels.quant_weight.QuantizedTensor`), read from the file.

Weights always come under Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``)
and in Hugging Face layout, whatever the file format. Every failure is a
:class:`kvserve.errors.ModelLoadError` naming the ``model`` parameter.
Only :func:`resolve_model` of a hub id touches the network, through
``huggingface_hub`` (never with ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvserve.loader.gguf_config import load_gguf_arch_config
from kvserve.loader.gguf_weights import iter_gguf_weights
from kvserve.loader.hf_folder import iter_safetensors_weights, load_hf_arch_config
from kvserve.loader.model_cache import cached_arch_config
from kvserve.loader.model_size import check_weights_fit_files
from kvserve.loader.quantize import QUANTIZE_AT_LOAD, CheckpointValue, quantize_weights
from kvserve.loader.resolve import ALIASES, ModelAlias, resolve_model
from kvserve.loader.source import ModelSource
from kvserve.loader.tokenizer import load_tokenizer
from kvserve.loader.weight_cache import CachedWeights, WeightOrigin
from kvserve.models.arch_config import ArchConfig

__all__ = [
    "ALIASES",
    "CachedWeights",
    "ModelAlias",
    "ModelSource",
    "WeightOrigin",
    "iter_weights",
    "load_arch_config",
    "load_tokenizer",
    "resolve_model",
]


def load_arch_config(source: ModelSource) -> ArchConfig:
    """The model's hyperparameters, from ``config.json`` (hf) or GGUF metadata (gguf, cached).

    Every value is range-checked, and the weights the config describes must
    fit in the model's files (see :mod:`kvserve.loader.model_size`), so what a
    model built from it allocates is bounded by the files' size.
    """
    if source.kind == "hf":
        arch = load_hf_arch_config(source.path)
    else:
        arch = cached_arch_config(source, lambda: load_gguf_arch_config(source.path))
    check_weights_fit_files(source, arch)
    return arch


def iter_weights(
    source: ModelSource, arch: ArchConfig, quantization: str = "auto"
) -> Iterator[tuple[str, CheckpointValue]]:
    """Yield ``(hf_name, tensor)`` pairs one at a time.

    hf: the stored tensors in their stored dtype. gguf: dequantized float32
    tensors, q/k rows restored to Hugging Face order. ``lm_head.weight`` appears
    only when the file has one (untied embeddings). quantization ``q8_0``,
    ``q4_0`` or ``q4_k`` (``ModelConfig.quantization``): projection weights and
    token embeddings come as :class:`~kvserve.kernels.quant_weight.QuantizedTensor`
    in that format (see :mod:`kvserve.loader.quantize`).
    """
    weights: Iterator[tuple[str, CheckpointValue]]
    if source.kind == "hf":
        weights = iter_safetensors_weights(source.path)
    else:
        weights = iter_gguf_weights(source.path, arch)
    if quantization in QUANTIZE_AT_LOAD:
        return quantize_weights(weights, quantization, arch)
    return weights
