"""GPT-2's config.json, read into ArchConfig's fields.

GPT-2 names its hyperparameters differently from the Llama family (``n_embd``,
``n_layer``, ``n_head``, ``n_positions``, ``n_inner``, ``layer_norm_epsilon``,
``activation_function``); each is checked against the limits of the
ArchConfig field it fills, and errors name GPT-2's key.
"""

from __future__ import annotations

from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.layers.activation import GELU_APPROXIMATIONS
from kvserve.models.arch_limits import (
    checked_bool,
    checked_int,
    checked_positive_float,
    token_ids_of,
)

# GPT-2 config.json flags that change the model's math, and the values kvserve computes.
_GPT2_FIXED_FLAGS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}


def gpt2_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ArchConfig's fields from GPT-2's config.json (``n_embd``, ``n_layer``, ...), checked
    against ArchConfig's limits."""

    def integer(key: str, limits_of: str, default: Any = None) -> int:
        return checked_int(config.get(key, default), limits_of, key)

    hidden_size = integer("n_embd", "hidden_size")
    num_heads = integer("n_head", "num_attention_heads")
    if hidden_size % num_heads != 0:
        raise ModelLoadError(
            f"n_embd ({hidden_size}) must be a multiple of n_head ({num_heads})", field="n_embd"
        )
    n_inner = config.get("n_inner")
    activation = config.get("activation_function", "gelu_new")
    if activation not in GELU_APPROXIMATIONS:
        raise ModelLoadError(
            f"activation_function {activation!r} is not supported; supported: "
            f"{', '.join(sorted(GELU_APPROXIMATIONS))}",
            field="activation_function",
        )
    for flag, value in _GPT2_FIXED_FLAGS.items():
        if config.get(flag, value) != value:
            raise ModelLoadError(f"{flag} must be {str(value).lower()} for GPT-2", field=flag)
    bos_token_id, eos_token_ids = token_ids_of(config)
    return dict(
        architecture=architecture,
        vocab_size=integer("vocab_size", "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size
        if n_inner is None
        else checked_int(n_inner, "intermediate_size", "n_inner"),
        num_hidden_layers=integer("n_layer", "num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        rms_norm_eps=checked_positive_float(
            config.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon", below=1.0
        ),
        rope_theta=10000.0,  # unused: GPT-2 learns its position embeddings
        max_position_embeddings=integer("n_positions", "max_position_embeddings", 1024),
        tie_word_embeddings=checked_bool(
            config.get("tie_word_embeddings", True), "tie_word_embeddings"
        ),
        attention_bias=True,
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
        hidden_act=activation,
    )
