"""Build an :class:`ArchConfig` from a GGUF file's metadata and tensor table.

Hyperparameters live under ``<arch>.*`` keys (``llama.block_count``, ...).
Flags that GGUF does not store are read off the tensor table, as llama.cpp
itself does: tied embeddings mean there is no ``output.weight``, Qwen2's q/k/v
bias shows as ``blk.0.attn_q.bias``, Qwen3's and Gemma 3's per-head norm as
``blk.0.attn_q_norm.weight``. What llama.cpp fixes in code for Gemma (which
layers slide, the query scale, the local RoPE base) follows llama.cpp too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_file import field_length, field_value, open_gguf, tensor_names
from kvserve.loader.gguf_rope import rope_scaling_from_gguf
from kvserve.loader.gguf_types import GGUFFile
from kvserve.models.arch_config import ArchConfig
from kvserve.models.arch_limits import (
    ARCH_LIMITS,
    checked_int,
    checked_positive_float,
    checked_token_id,
)
from kvserve.models.families import gguf_architectures

# llama.cpp's Gemma layer patterns: every n-th layer is global, the others slide.
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
# The layer count of each family's 27B model, the one whose queries llama.cpp (and the
# published config) scales by hidden_size / num_heads instead of head_dim.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's RoPE base of Gemma 3's sliding layers when the file does not store one.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0

# llama.cpp's own default when a file omits rope.freq_base.
_DEFAULT_ROPE_THETA = 10000.0

# A default that means "this key must be present".
_REQUIRED = object()


def gguf_architecture(reader: GGUFFile) -> str:
    """``general.architecture``, checked against the supported list."""
    arch = field_value(reader, "general.architecture")
    supported = gguf_architectures()
    if arch not in supported:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(supported)}",
            field="general.architecture",
        )
    return str(arch)


class _Hparams:
    """The ``<arch>.*`` metadata of one file, read with the type and range each value needs."""

    def __init__(self, reader: GGUFFile, arch: str) -> None:
        self.reader = reader
        self.arch = arch

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        full_key = f"{self.arch}.{key}"
        field = self.reader.fields.get(full_key)
        if field is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"GGUF metadata {full_key} is missing", field=full_key)
            return default
        # Some files store per-layer arrays (e.g. head_count); we need one value.
        # The length is checked before the items become Python objects.
        if field.value_type == GGUFValueType.ARRAY:
            if not 1 <= len(field) <= ARCH_LIMITS["num_hidden_layers"][1]:
                raise ModelLoadError(
                    f"GGUF metadata {full_key} is an array of {len(field)} items; a per-layer "
                    "value needs one per layer",
                    field=full_key,
                )
            values = field_value(self.reader, full_key)
            if any(v != values[0] for v in values):
                raise ModelLoadError(
                    f"GGUF metadata {full_key} varies per layer ({values}); not supported",
                    field=full_key,
                )
            return values[0]
        return field_value(self.reader, full_key)

    def integer(self, key: str, limits_of: str, default: Any = _REQUIRED) -> int:
        """An integer within ``ARCH_LIMITS[limits_of]``, the error naming the GGUF key."""
        value = self.value(key, default)
        return checked_int(value, limits_of, f"{self.arch}.{key}", prefix="GGUF metadata ")

    def positive_float(self, key: str, default: Any = _REQUIRED, below: float = math.inf) -> float:
        value = self.value(key, default)
        return checked_positive_float(value, f"{self.arch}.{key}", below, prefix="GGUF metadata ")


def load_gguf_arch_config(path: Path) -> ArchConfig:
    """Read the model's shape from the GGUF file at ``path``."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    names = tensor_names(reader)
    hparams = _Hparams(reader, arch)
    hidden_size = hparams.integer("embedding_length", "hidden_size")
    num_heads = hparams.integer("attention.head_count", "num_attention_heads")
    if f"{arch}.attention.key_length" not in reader.fields and hidden_size % num_heads != 0:
        raise ModelLoadError(
            f"GGUF metadata {arch}.embedding_length ({hidden_size}) must be a multiple of "
            f"{arch}.attention.head_count ({num_heads}) when key_length is not given",
            field=f"{arch}.embedding_length",
        )
    head_dim = hparams.integer("attention.key_length", "head_dim", hidden_size // num_heads)
    value_dim = hparams.integer("attention.value_length", "head_dim", head_dim)
    rope_dims = hparams.integer("rope.dimension_count", "head_dim", head_dim)
    if value_dim != head_dim or rope_dims != head_dim:
        raise ModelLoadError(
            f"GGUF key_length {head_dim}, value_length {value_dim} and "
            f"rope.dimension_count {rope_dims} must be equal (partial RoPE and "
            "different K/V head sizes are not supported)",
            field=f"{arch}.attention.value_length"
            if value_dim != head_dim
            else f"{arch}.rope.dimension_count",
        )
    rope_theta = hparams.positive_float("rope.freq_base", _DEFAULT_ROPE_THETA)
    num_layers = hparams.integer("block_count", "num_hidden_layers")
    gemma = (
        _gemma_fields(hparams, num_layers, hidden_size // num_heads, head_dim)
        if arch in _GEMMA_SLIDING_PATTERN
        else {}
    )
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = field_value(reader, key)
        if token_id is not None and checked_token_id(token_id, key) not in eos_ids:
            eos_ids.append(token_id)
    return ArchConfig(
        architecture=arch,
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden_size,
        intermediate_size=hparams.integer("feed_forward_length", "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=hparams.integer(
            "attention.head_count_kv", "num_key_value_heads", num_heads
        ),
        head_dim=head_dim,
        rms_norm_eps=hparams.positive_float("attention.layer_norm_rms_epsilon", below=1.0),
        rope_theta=rope_theta,
        max_position_embeddings=hparams.integer("context_length", "max_position_embeddings"),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=rope_scaling_from_gguf(reader, arch, head_dim, rope_theta),
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=None if bos is None else checked_token_id(bos, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        **gemma,
    )


def _gemma_fields(
    hparams: _Hparams, num_layers: int, hidden_per_head: int, head_dim: int
) -> dict[str, Any]:
    """The Gemma-only ArchConfig fields of a ``gemma2``/``gemma3`` file."""
    arch = hparams.arch
    window = hparams.integer("attention.sliding_window", "sliding_window")
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    field = hparams.reader.fields.get(pattern_key)
    if field is not None and field.value_type == GGUFValueType.ARRAY:
        # One flag per layer, true where the layer slides (checked before decoding).
        if len(field) != num_layers:
            raise ModelLoadError(
                f"GGUF metadata {pattern_key} has {len(field)} entries for {num_layers} layers",
                field=pattern_key,
            )
        sliding = [bool(flag) for flag in field_value(hparams.reader, pattern_key)]
    else:
        pattern = hparams.integer(
            "attention.sliding_window_pattern", "num_hidden_layers", _GEMMA_SLIDING_PATTERN[arch]
        )
        # As llama.cpp: every pattern-th layer is global; a pattern of 0 slides everywhere.
        sliding = [pattern == 0 or (index + 1) % pattern != 0 for index in range(num_layers)]
    is_27b = num_layers == _GEMMA_27B_LAYERS[arch]
    fields: dict[str, Any] = {
        "sliding_window": window,
        "layer_types": tuple(
            "sliding_attention" if slides else "full_attention" for slides in sliding
        ),
        "query_pre_attn_scalar": float(hidden_per_head if is_27b else head_dim),
        "hidden_act": "gelu_pytorch_tanh",  # GeGLU, as from config.json
        "final_logit_softcapping": hparams.positive_float("final_logit_softcapping")
        if f"{arch}.final_logit_softcapping" in hparams.reader.fields
        else None,
    }
    if arch == "gemma2":
        if f"{arch}.attn_logit_softcapping" in hparams.reader.fields:
            fields["attn_logit_softcapping"] = hparams.positive_float("attn_logit_softcapping")
    else:
        fields["rope_local_base_freq"] = hparams.positive_float(
            "rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA
        )
    return fields


def _vocab_size(reader: GGUFFile, arch: str) -> int:
    # Newer converters write <arch>.vocab_size; older ones only the token list.
    key = f"{arch}.vocab_size"
    stored = field_value(reader, key)
    if stored is not None:
        return checked_int(stored, "vocab_size", key, prefix="GGUF metadata ")
    num_tokens = field_length(reader, "tokenizer.ggml.tokens")
    if num_tokens is not None:
        return num_tokens
    raise ModelLoadError(
        f"GGUF has neither {key} nor tokenizer.ggml.tokens", field="tokenizer.ggml.tokens"
    )
