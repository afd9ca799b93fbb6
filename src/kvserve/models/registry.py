"""Architecture name → model class."""

from __future__ import annotations

import torch

from kvserve.attention import AttentionBackend
from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.gemma import GemmaForCausalLM
from kvserve.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[LlamaForCausalLM | GemmaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
}


def build_model(
    arch: ArchConfig, max_position: int, dtype: torch.dtype, backend: AttentionBackend
) -> LlamaForCausalLM | GemmaForCausalLM:
    """An uninitialised model of the right class; fill it with ``load_weights``."""
    model_class = _MODELS.get(arch.architecture)
    if model_class is None:
        raise ModelLoadError(
            f"architecture {arch.architecture!r} is not supported; supported: "
            f"{', '.join(sorted(_MODELS))}"
        )
    return model_class(arch, max_position, dtype, backend)
