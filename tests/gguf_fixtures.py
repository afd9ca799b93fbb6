"""Tiny GGUF files of the Llama family, laid out the way llama.cpp's converter lays them out.

HF names are mapped to GGUF names, q/k rows of the llama architecture are
permuted to interleaved RoPE pairs, 1-D tensors are F32 and matrices cycle
through the quantization types.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from model_fixtures import train_tiny_tokenizer

Q = gguf.GGMLQuantizationType

# Matrices cycle through these types, so every type meets every kind of tensor.
MATRIX_TYPES = [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16, Q.F32]

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass(frozen=True)
class TinySpec:
    """A tiny model of the Llama family and how its GGUF file is written."""

    arch: str = "llama"
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    vocab: int = 96
    layers: int = 2
    tied: bool = True
    all_f32: bool = False
    rope_theta: float = 50000.0
    # Extra metadata and raw tensors (GGUF name → (array, type)) to add, metadata to leave out.
    extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None
    extra_tensors: dict[str, tuple[np.ndarray, Q]] = field(default_factory=dict)
    write_vocab_size: bool = True
    # The token list to store; placeholder names when empty.
    tokens: tuple[str, ...] = ()


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permutation: rotate-half rows → interleaved pairs."""
    half = weight.shape[0] // num_heads // 2
    by_half = weight.reshape(num_heads, 2, half, *weight.shape[1:])
    return by_half.swapaxes(1, 2).reshape(weight.shape)


def hf_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face names and layout."""
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (0.1 * rng.standard_normal((rows, cols))).astype(np.float32)

    def vector(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    weights = {
        "model.embed_tokens.weight": matrix(spec.vocab, spec.hidden),
        "model.norm.weight": vector(spec.hidden),
    }
    if not spec.tied:
        weights["lm_head.weight"] = matrix(spec.vocab, spec.hidden)
    for layer in range(spec.layers):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "input_layernorm.weight": vector(spec.hidden),
            prefix + "post_attention_layernorm.weight": vector(spec.hidden),
            prefix + "self_attn.q_proj.weight": matrix(q_rows, spec.hidden),
            prefix + "self_attn.k_proj.weight": matrix(kv_rows, spec.hidden),
            prefix + "self_attn.v_proj.weight": matrix(kv_rows, spec.hidden),
            prefix + "self_attn.o_proj.weight": matrix(spec.hidden, q_rows),
            prefix + "mlp.gate_proj.weight": matrix(spec.ffn, spec.hidden),
            prefix + "mlp.up_proj.weight": matrix(spec.ffn, spec.hidden),
            prefix + "mlp.down_proj.weight": matrix(spec.hidden, spec.ffn),
        }
        if spec.arch == "qwen2":
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                weights[prefix + f"self_attn.{proj}_proj.bias"] = vector(rows)
        if spec.arch == "qwen3":
            weights[prefix + "self_attn.q_norm.weight"] = vector(spec.head_dim)
            weights[prefix + "self_attn.k_norm.weight"] = vector(spec.head_dim)
    return weights


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{kind}"


def tensor_types(spec: TinySpec, weights: dict[str, np.ndarray]) -> dict[str, Q]:
    matrices = sorted(name for name, array in weights.items() if array.ndim == 2)
    types = {name: Q.F32 for name, array in weights.items() if array.ndim == 1}
    for index, name in enumerate(matrices):
        types[name] = Q.F32 if spec.all_f32 else MATRIX_TYPES[index % len(MATRIX_TYPES)]
    return types


def write_gguf(path: Path, spec: TinySpec) -> tuple[dict[str, np.ndarray], dict[str, Q]]:
    """Write ``spec`` as a GGUF file; returns the HF weights and each one's stored type."""
    weights = hf_weights(spec)
    types = tensor_types(spec, weights)
    writer = gguf.GGUFWriter(path, spec.arch)
    writer.add_block_count(spec.layers)
    writer.add_context_length(512)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    if spec.head_dim != spec.hidden // spec.heads:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(spec.rope_theta)
    if spec.write_vocab_size:
        writer.add_vocab_size(spec.vocab)
    writer.add_token_list(list(spec.tokens) or [f"tok{i}" for i in range(spec.vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if spec.extra_metadata is not None:
        spec.extra_metadata(writer)
    for hf_name, array in weights.items():
        stored = array
        if spec.arch == "llama" and ".q_proj." in hf_name:
            stored = llama_cpp_permute(array, spec.heads)
        elif spec.arch == "llama" and ".k_proj." in hf_name:
            stored = llama_cpp_permute(array, spec.kv_heads)
        writer.add_tensor(
            gguf_name(hf_name),
            gguf.quants.quantize(stored, types[hf_name]),
            raw_dtype=types[hf_name],
        )
    for name, (array, qtype) in spec.extra_tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights, types


def llama_cpp_rope_factors(head_dim: int, theta: float, scaling: dict[str, float]) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for Llama 3 scaling."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for index in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (index / head_dim)
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def with_tiny_tokenizer(spec: TinySpec, chat_template: str | None = None) -> TinySpec:
    """``spec`` carrying model_fixtures' tiny BPE tokenizer as GGUF metadata, as transformers reads it."""
    vocab = json.loads(train_tiny_tokenizer().backend_tokenizer.to_str())["model"]
    tokens = tuple(sorted(vocab["vocab"], key=vocab["vocab"].__getitem__))
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]
    earlier = spec.extra_metadata

    def tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
        if earlier is not None:
            earlier(writer)
        writer.add_tokenizer_model("gpt2")
        writer.add_token_merges(merges)
        if chat_template is not None:
            writer.add_chat_template(chat_template)

    return replace(spec, vocab=len(tokens), tokens=tokens, extra_metadata=tokenizer_metadata)
