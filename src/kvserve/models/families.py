"""What kvserve knows of each architecture it runs, as data: the one table of them.

:data:`FAMILIES` maps an architecture (``ArchConfig.architecture``) to its
``config.json`` model types, the reader of its config files, and the facts
the rest of kvserve asks about it (tensor parallelism, GGUF files, the shape
of a layer that the parameter count needs). The classes that run each
architecture are in ``registry.py``, which imports the models; this table
imports none, so :class:`~kvserve.models.arch_config.ArchConfig` validates
against it without an import loop.

A new family is a row here, a config reader (``<family>_config.py``), a
model file and a line in ``registry.MODEL_CLASSES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.models.bert_config import bert_fields
from kvserve.models.gemma_config import gemma_fields
from kvserve.models.gpt2_config import gpt2_fields
from kvserve.models.llama_config import llama_fields

# A family's reader: a parsed config.json and the architecture it is → ArchConfig's fields,
# each checked against ArchConfig's limits; ModelLoadError names the file's key.
ConfigReader = Callable[[dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """One architecture.

    hf_model_types: the ``config.json`` ``model_type`` values that are this architecture.
    read_config: reads its ``config.json`` into ArchConfig's fields.
    tensor_parallel: its layers can be split over tensor-parallel ranks.
    gguf: GGUF files whose ``general.architecture`` is this architecture's name are read.
    learned_positions: positions are a learned embedding table of
        ``max_position_embeddings`` rows (GPT-2) instead of RoPE rotating q and k.
    gated_mlp: the MLP is gate, up and down, its activation ``silu`` (SwiGLU) or
        a GELU (GeGLU); else up and down around a GELU (GPT-2).
    norms_per_layer: 2 (before attention and before the MLP) or 4 (Gemma: after
        them too).
    layer_norm: the norms are LayerNorm, a weight and a bias (GPT-2), not RMSNorm.
    output_biases: the attention output and MLP projections carry biases (GPT-2);
        the q/k/v biases are ``ArchConfig.attention_bias``.
    encoder: a bidirectional encoder (BERT) with no LM head: it embeds text and
        never generates; its requests are pooled (``--task embed``).
    """

    hf_model_types: tuple[str, ...]
    read_config: ConfigReader
    tensor_parallel: bool = True
    gguf: bool = True
    learned_positions: bool = False
    gated_mlp: bool = True
    norms_per_layer: int = 2
    layer_norm: bool = False
    output_biases: bool = False
    encoder: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(("llama", "mistral"), llama_fields),
    "qwen2": Family(("qwen2",), llama_fields),
    "qwen3": Family(("qwen3",), llama_fields),
    "gpt2": Family(
        ("gpt2",),
        gpt2_fields,
        tensor_parallel=False,
        gguf=False,
        learned_positions=True,
        gated_mlp=False,
        layer_norm=True,
        output_biases=True,
    ),
    # Post-norm encoder: LayerNorm after attention and after the MLP, token types.
    "bert": Family(
        ("bert",),
        bert_fields,
        tensor_parallel=False,
        gguf=False,
        learned_positions=True,
        gated_mlp=False,
        layer_norm=True,
        output_biases=True,
        encoder=True,
    ),
    "gemma2": Family(("gemma2",), gemma_fields, norms_per_layer=4),
    # gemma3: the multimodal config too, whose text part is run.
    "gemma3": Family(("gemma3_text", "gemma3"), gemma_fields, norms_per_layer=4),
}


def architecture_of_model_type(model_type: object) -> str:
    """The architecture of a ``config.json`` ``model_type``; ModelLoadError listing the supported ones."""
    for architecture, family in FAMILIES.items():
        if model_type in family.hf_model_types:
            return architecture
    supported = sorted(t for family in FAMILIES.values() for t in family.hf_model_types)
    raise ModelLoadError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(supported)}",
        field="model_type",
    )


def check_architecture(architecture: str) -> None:
    """Raise ModelLoadError, listing the supported architectures, unless ``architecture`` is one."""
    if architecture not in FAMILIES:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(FAMILIES))}",
            field="architecture",
        )


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF ``general.architecture`` values kvserve reads (Mistral GGUFs say ``llama``)."""
    return tuple(name for name, family in FAMILIES.items() if family.gguf)
