"""The honest model files the fuzzer mutates: tiny GGUF files and Hugging Face folders.

Each base is small (tens to a few hundred KB) and carries a working tokenizer
(model_fixtures' tiny BPE vocabulary), so that a case loads in milliseconds
and gets as far as an honest one would. Together they reach every branch of the loader: the three
architectures, quantized and float tensors, tied and untied heads, llama3
RoPE scaling from a ``rope_freqs`` tensor, a single safetensors file and a
sharded one with an index, float32 and bfloat16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
import transformers

from gguf_fixtures import TinySpec, llama_cpp_rope_factors, with_tiny_tokenizer, write_gguf
from model_fixtures import TINY_VOCAB_SIZE, train_tiny_tokenizer

_LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

GGUF_SPECS = {
    "gguf-llama": TinySpec(arch="llama"),
    "gguf-qwen2": TinySpec(arch="qwen2", tied=False),
    "gguf-qwen3": TinySpec(arch="qwen3", head_dim=32),
    "gguf-llama3-rope": TinySpec(
        hidden=64,
        heads=2,
        kv_heads=1,
        head_dim=32,
        tied=False,
        extra_tensors={
            "rope_freqs.weight": (
                llama_cpp_rope_factors(32, 50000.0, _LLAMA3_SCALING),
                gguf.GGMLQuantizationType.F32,
            )
        },
    ),
}

_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"

_HF_SHAPE = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@dataclass(frozen=True)
class BaseModel:
    """A base model on disk: a ``.gguf`` file or a Hugging Face folder."""

    name: str
    kind: str  # "gguf" or "hf"
    path: Path


def build_bases(folder: Path) -> list[BaseModel]:
    """Write every base model under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    bases = []
    for name, spec in GGUF_SPECS.items():
        path = folder / f"{name}.gguf"
        write_gguf(path, with_tiny_tokenizer(spec, _CHAT_TEMPLATE))
        bases.append(BaseModel(name, "gguf", path))
    torch.manual_seed(0)
    hf_models = {
        "hf-llama": (
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    **_HF_SHAPE,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0}
                    | _LLAMA3_SCALING,
                )
            ),
            "1GB",
        ),
        "hf-qwen2-sharded": (
            transformers.Qwen2ForCausalLM(
                transformers.Qwen2Config(**_HF_SHAPE, tie_word_embeddings=True)
            ),
            "20KB",
        ),
        "hf-qwen3-bf16": (
            transformers.Qwen3ForCausalLM(
                transformers.Qwen3Config(**_HF_SHAPE, head_dim=32, tie_word_embeddings=False)
            ).bfloat16(),
            "1GB",
        ),
    }
    tokenizer = train_tiny_tokenizer()
    for name, (model, shard_size) in hf_models.items():
        path = folder / name
        model.save_pretrained(path, max_shard_size=shard_size)
        tokenizer.save_pretrained(path)
        bases.append(BaseModel(name, "hf", path))
    return bases
