"""Which model class runs each architecture: the one module that imports the model classes.

Decoders are :class:`CausalLM`; an encoder (BERT) is its own class, which has
no LM head and whose output is only ever pooled.

What each architecture is (its ``config.json`` model types, its config
reader, what it supports) is data in ``families.py``; this table only pairs
each architecture with its class. A new family is a line here, its row in
``families.FAMILIES``, its config reader and its model file.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.attention import AttentionBackend
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.errors import InvalidParameterError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.bert import BertModel
from kvserve.models.causal_lm import CausalLM
from kvserve.models.families import check_architecture
from kvserve.models.gemma import GemmaForCausalLM
from kvserve.models.gpt2 import GPT2LMHeadModel
from kvserve.models.llama import LlamaForCausalLM


class ModelClass(Protocol):
    """A family's model class, as the registry builds it (see :class:`CausalLM`)."""

    def __call__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
    ) -> CausalLM | BertModel: ...


# Architecture (a key of families.FAMILIES) → the class that builds and runs it.
MODEL_CLASSES: dict[str, ModelClass] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "bert": BertModel,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
}


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
    if not arch.family.tensor_parallel:
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
) -> CausalLM | BertModel:
    """An uninitialised model of the right class, this rank's share of it under ``tp``;
    fill it with ``load_weights``."""
    check_architecture(arch.architecture)
    check_tensor_parallel_size(arch, tp.size)
    return MODEL_CLASSES[arch.architecture](arch, max_position, dtype, backend, tp)
