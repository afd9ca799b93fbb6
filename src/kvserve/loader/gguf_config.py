"""Build an :class:`ArchConfig` from a GGUF file's metadata and tensor table.

Hyperparameters live under ``<arch>.*`` keys (``llama.block_count``, ...).
Flags that GGUF does not store are read off the tensor table, as llama.cpp
itself does: tied embeddings mean there is no ``output.weight``, Qwen2's q/k/v
bias shows as ``blk.0.attn_q.bias``, Qwen3's per-head norm as
``blk.0.attn_q_norm.weight``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_file import field_length, field_value, open_gguf, tensor_names
from kvserve.loader.gguf_rope import rope_scaling_from_gguf
from kvserve.models.arch_config import ArchConfig

# GGUF ``general.architecture`` values we run. Mistral GGUFs say "llama".
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# llama.cpp's own default when a file omits rope.freq_base.
_DEFAULT_ROPE_THETA = 10000.0


def gguf_architecture(reader: gguf.GGUFReader) -> str:
    """``general.architecture``, checked against the supported list."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return str(arch)


def load_gguf_arch_config(path: Path) -> ArchConfig:
    """Read the model's shape from the GGUF file at ``path``."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    names = tensor_names(reader)

    def hparam(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ModelLoadError(f"GGUF metadata {arch}.{key} is missing")
            return default
        # Some files store per-layer arrays (e.g. head_count); we need one value.
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise ModelLoadError(
                    f"GGUF metadata {arch}.{key} varies per layer ({value}); not supported"
                )
            return value[0]
        return value

    try:
        hidden_size = int(hparam("embedding_length"))
        num_heads = int(hparam("attention.head_count"))
        head_dim = int(hparam("attention.key_length", hidden_size // num_heads))
        value_dim = int(hparam("attention.value_length", head_dim))
        rope_dims = int(hparam("rope.dimension_count", head_dim))
        rope_theta = float(hparam("rope.freq_base", _DEFAULT_ROPE_THETA))
        context_length = int(hparam("context_length"))
        vocab_size = _vocab_size(reader, arch)
        bos = field_value(reader, "tokenizer.ggml.bos_token_id")
        eos_ids: list[int] = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            token_id = field_value(reader, key)
            if token_id is not None and int(token_id) not in eos_ids:
                eos_ids.append(int(token_id))
        if value_dim != head_dim or rope_dims != head_dim:
            raise ModelLoadError(
                f"GGUF key_length {head_dim}, value_length {value_dim} and "
                f"rope.dimension_count {rope_dims} must be equal (partial RoPE and "
                "different K/V head sizes are not supported)"
            )
        return ArchConfig(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(hparam("feed_forward_length")),
            num_hidden_layers=int(hparam("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hparam("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(hparam("attention.layer_norm_rms_epsilon")),
            rope_theta=rope_theta,
            max_position_embeddings=context_length,
            tie_word_embeddings="output.weight" not in names,
            rope_scaling=rope_scaling_from_gguf(reader, arch, head_dim, rope_theta),
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
        )
    except ModelLoadError:
        raise
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"GGUF metadata of {path} has a bad value: {exc}") from exc


def _vocab_size(reader: gguf.GGUFReader, arch: str) -> int:
    # Newer converters write <arch>.vocab_size; older ones only the token list.
    stored = field_value(reader, f"{arch}.vocab_size")
    if stored is not None:
        return int(stored)
    num_tokens = field_length(reader, "tokenizer.ggml.tokens")
    if num_tokens is not None:
        return num_tokens
    raise ModelLoadError(f"GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
