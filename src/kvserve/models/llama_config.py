"""The Llama family's ``config.json`` (Llama, SmolLM2, Mistral, Qwen2, Qwen3), read into ArchConfig's fields.

Its keys are ArchConfig's own field names; the members differ in a few
flags the files leave implicit (Qwen2's q/k/v biases, Qwen3's q/k norms) and
in how they describe sliding windows. Gemma's reader flattens its files to
these keys and reads them with :func:`llama_style_fields` too.
"""

from __future__ import annotations

from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.models.arch_limits import checked_bool, checked_int, token_ids_of


def llama_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ArchConfig's fields from a Llama-family ``config.json`` (``architecture`` is
    ``llama``, ``qwen2`` or ``qwen3``)."""
    fields = llama_style_fields(config, architecture)
    return {
        **fields,
        **_sliding_windows(config, architecture, fields["num_hidden_layers"]),
        "qk_norm": architecture == "qwen3",
    }


def llama_style_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The fields a config.json names as ArchConfig does: sizes, RoPE, token ids, flags.

    Sliding windows, q/k norms and the activation are left to the family's reader.
    """

    def integer(key: str, default: Any = None) -> int:
        return checked_int(config.get(key, default), key, key)

    num_heads = integer("num_attention_heads")
    hidden_size = integer("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise ModelLoadError(
                f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads "
                f"({num_heads}) when config.json has no head_dim",
                field="hidden_size",
            )
        head_dim = hidden_size // num_heads
    rope_scaling = config.get("rope_scaling")
    rope_theta = config.get("rope_theta")
    # transformers 5 moves rope_theta into rope_parameters.
    rope_parameters = config.get("rope_parameters")
    if isinstance(rope_parameters, dict):
        rope_theta = rope_theta or rope_parameters.get("rope_theta")
        if rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_scaling or rope_parameters
    if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
        rope_scaling = None
    max_positions = integer("max_position_embeddings", 2048)
    bos_token_id, eos_token_ids = token_ids_of(config)
    return dict(
        architecture=architecture,
        vocab_size=integer("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=integer("intermediate_size"),
        num_hidden_layers=integer("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=checked_int(
            config.get("num_key_value_heads") or num_heads,
            "num_key_value_heads",
            "num_key_value_heads",
        ),
        head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta or 10000.0,
        max_position_embeddings=max_positions,
        tie_word_embeddings=checked_bool(
            config.get("tie_word_embeddings", False), "tie_word_embeddings"
        ),
        rope_scaling=rope_scaling,
        attention_bias=checked_bool(
            config.get("attention_bias", architecture == "qwen2"), "attention_bias"
        ),
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
    )


def _sliding_windows(config: dict[str, Any], architecture: str, num_layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a Llama-family config (Mistral, Qwen2), if any.

    Mistral slides every layer; Qwen2 (with ``use_sliding_window``) the layers
    from ``max_window_layers`` on, unless the config lists ``layer_types``.
    """
    window = config.get("sliding_window")
    if not window or not config.get("use_sliding_window", True):
        return {}
    window = checked_int(window, "sliding_window", "sliding_window")
    given = config.get("layer_types")
    if isinstance(given, list):
        layer_types = tuple(str(t) for t in given)
    else:
        first = config.get("max_window_layers", 0) if architecture == "qwen2" else 0
        first = checked_int(first, "num_hidden_layers", "max_window_layers") if first else 0
        layer_types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        )
    if "sliding_attention" not in layer_types:
        return {}
    return {"sliding_window": window, "layer_types": layer_types}
