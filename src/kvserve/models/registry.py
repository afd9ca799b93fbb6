"""Architecture name → model class."""

from __future__ import annotations

import torch

from kvserve.attention import AttentionBackend
from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.llama import LlamaForCausalLM

_MODELS = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(
    arch: ArchConfig, max_position: int, dtype: torch.dtype, backend: AttentionBackend
) -> LlamaForCausalLM:
    """An uninitialised model of the right class; fill it with ``load_weights``."""
    model_class = _MODELS.get(arch.architecture)
    if model_class is None:
        raise ModelLoadError(f"architecture {arch.architecture!r} is not supported")
    return model_class(arch, max_position, dtype, backend)
