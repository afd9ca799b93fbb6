"""BERT's config.json (``model_type`` ``bert``), read into ArchConfig's fields.

BERT names most hyperparameters as the Llama family does; what differs is
what it adds: ``type_vocab_size`` token types (segments A and B) and
``layer_norm_eps``. Only absolute learned positions are supported
(``position_embedding_type`` ``absolute``); relative position variants
would silently compute something else, so they are refused by name.
"""

from __future__ import annotations

from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.layers.activation import GELU_APPROXIMATIONS
from kvserve.models.arch_limits import checked_int, checked_positive_float


def bert_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ArchConfig's fields from BERT's config.json, checked against ArchConfig's limits."""

    def integer(key: str, limits_of: str, default: Any = None) -> int:
        return checked_int(config.get(key, default), limits_of, key)

    hidden_size = integer("hidden_size", "hidden_size")
    num_heads = integer("num_attention_heads", "num_attention_heads")
    if hidden_size % num_heads != 0:
        raise ModelLoadError(
            f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_heads})",
            field="hidden_size",
        )
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ModelLoadError(
            f"position_embedding_type {position_type!r} is not supported; supported: absolute",
            field="position_embedding_type",
        )
    if config.get("is_decoder", False):
        raise ModelLoadError("is_decoder must be false: BERT runs as an encoder", "is_decoder")
    activation = config.get("hidden_act", "gelu")
    if activation not in GELU_APPROXIMATIONS:
        raise ModelLoadError(
            f"hidden_act {activation!r} is not supported; supported: "
            f"{', '.join(sorted(GELU_APPROXIMATIONS))}",
            field="hidden_act",
        )
    type_vocab_size = checked_int(config.get("type_vocab_size", 2), "vocab_size", "type_vocab_size")
    return dict(
        architecture=architecture,
        vocab_size=integer("vocab_size", "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=integer("intermediate_size", "intermediate_size"),
        num_hidden_layers=integer("num_hidden_layers", "num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        rms_norm_eps=checked_positive_float(
            config.get("layer_norm_eps", 1e-12), "layer_norm_eps", below=1.0
        ),
        rope_theta=10000.0,  # unused: BERT learns its position embeddings
        max_position_embeddings=integer("max_position_embeddings", "max_position_embeddings", 512),
        tie_word_embeddings=False,  # an encoder has no LM head to tie
        attention_bias=True,
        hidden_act=activation,
        type_vocab_size=type_vocab_size,
    )
