"""Which model class runs each architecture, and which ``config.json`` model types are each.

:data:`ARCHITECTURES` is the one table: :class:`ArchConfig` accepts exactly
its architectures and Hugging Face model types, and :func:`build_model`
builds its classes. A new family is one line here (plus its config parsing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBackend
from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.causal_lm import CausalLM
from kvserve.models.gemma import GemmaForCausalLM
from kvserve.models.gpt2 import GPT2LMHeadModel
from kvserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    """model_class: builds and runs the architecture; hf_model_types: the ``config.json``
    ``model_type`` values that are this architecture."""

    model_class: type[CausalLM]
    hf_model_types: tuple[str, ...]


ARCHITECTURES: dict[str, ModelFamily] = {
    "llama": ModelFamily(LlamaForCausalLM, ("llama", "mistral")),
    "qwen2": ModelFamily(LlamaForCausalLM, ("qwen2",)),
    "qwen3": ModelFamily(LlamaForCausalLM, ("qwen3",)),
    "gpt2": ModelFamily(GPT2LMHeadModel, ("gpt2",)),
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


def build_model(
    arch: ArchConfig, max_position: int, dtype: torch.dtype, backend: AttentionBackend
) -> CausalLM:
    """An uninitialised model of the right class; fill it with ``load_weights``."""
    check_architecture(arch.architecture)
    return ARCHITECTURES[arch.architecture].model_class(arch, max_position, dtype, backend)
