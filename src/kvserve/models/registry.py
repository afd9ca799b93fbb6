"""Which model class runs each architecture, and which ``config.json`` model types are each.

:data:`ARCHITECTURES` is the one table: :class:`ArchConfig` accepts exactly
its architectures and Hugging Face model types, and :func:`build_model`
builds its classes. A new family is one line here (plus its config parsing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBackend
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.errors import InvalidParameterError, ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.causal_lm import CausalLM
from kvserve.models.gemma import GemmaForCausalLM
from kvserve.models.gpt2 import GPT2LMHeadModel
from kvserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    """model_class: builds and runs the architecture; hf_model_types: the ``config.json``
    ``model_type`` values that are this architecture; tensor_parallel: its layers
    can be split over tensor-parallel ranks."""

    model_class: type[CausalLM]
    hf_model_types: tuple[str, ...]
    tensor_parallel: bool = True


ARCHITECTURES: dict[str, ModelFamily] = {
    "llama": ModelFamily(LlamaForCausalLM, ("llama", "mistral")),
    "qwen2": ModelFamily(LlamaForCausalLM, ("qwen2",)),
    "qwen3": ModelFamily(LlamaForCausalLM, ("qwen3",)),
    "gpt2": ModelFamily(GPT2LMHeadModel, ("gpt2",), tensor_parallel=False),
    "gemma2": ModelFamily(GemmaForCausalLM, ("gemma2",)),
    # gemma3: the multimodal config too, whose text part is run.
    "gemma3": ModelFamily(GemmaForCausalLM, ("gemma3_text", "gemma3")),
}


def architecture_of_model_type(model_type: object) -> str:
    """The architecture of a ``config.json`` ``model_type``; ModelLoadError listing the supported ones."""
    for architecture, family in ARCHITECTURES.items():
        if model_type in family.hf_model_types:
            return architecture
    supported = sorted(t for family in ARCHITECTURES.values() for t in family.hf_model_types)
    raise ModelLoadError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(supported)}",
        field="model_type",
    )


def check_architecture(architecture: str) -> None:
    """Raise ModelLoadError, listing the supported architectures, unless ``architecture`` is one."""
    if architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}",
            field="architecture",
        )


def check_tensor_parallel_size(arch: ArchConfig, size: int) -> None:
    """Raise InvalidParameterError naming ``tensor_parallel_size`` unless ``arch`` splits
    over ``size`` ranks.

    Each rank must hold whole attention heads and whole GQA groups (the KV
    heads split evenly, so every rank's q heads find their KV head on the same
    rank), and an even share of the MLP's columns.
    """
    if size == 1:
        return
    check_architecture(arch.architecture)
    if not ARCHITECTURES[arch.architecture].tensor_parallel:
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"must be 1 for {arch.architecture} models (only 1 is supported), got {size}",
        )
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % size or kv_heads % size or arch.intermediate_size % size:
        allowed = [
            n
            for n in range(1, kv_heads + 1)
            if heads % n == 0 and kv_heads % n == 0 and arch.intermediate_size % n == 0
        ]
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"must divide the model's {heads} attention heads, {kv_heads} KV heads and "
            f"{arch.intermediate_size} MLP columns (each rank holds whole GQA groups); "
            f"allowed: {', '.join(map(str, allowed))}; got {size}",
        )


def build_model(
    arch: ArchConfig,
    max_position: int,
    dtype: torch.dtype,
    backend: AttentionBackend,
    tp: TensorParallelGroup = SINGLE_RANK,
) -> CausalLM:
    """An uninitialised model of the right class, this rank's share of it under ``tp``;
    fill it with ``load_weights``."""
    check_architecture(arch.architecture)
    check_tensor_parallel_size(arch, tp.size)
    family = ARCHITECTURES[arch.architecture]
    return family.model_class(arch, max_position, dtype, backend, tp)
