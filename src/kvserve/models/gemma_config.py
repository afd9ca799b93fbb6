"""Gemma 2 and Gemma 3 ``config.json`` files, read into ArchConfig's fields the way transformers reads them.

Three shapes arrive: ``gemma2``, ``gemma3_text`` (a text-only Gemma 3) and
``gemma3`` (the multimodal model, whose language model is described under
``text_config``). transformers fills every key a file leaves out with its own
defaults, and the multimodal files leave out most of them; the defaults below
are transformers 5's (``Gemma2Config``, ``Gemma3TextConfig``). RoPE comes as
the old keys (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) or as
transformers 5's ``rope_parameters``, one dict per layer type for Gemma 3.
"""

from __future__ import annotations

from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.models.llama_config import llama_style_fields

_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        **_COMMON_DEFAULTS,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {
        **_COMMON_DEFAULTS,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
}
_NULL_MEANS_OFF = (
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "sliding_window",
    "bos_token_id",
    "eos_token_id",
)
# Every `pattern`-th layer is global, the others slide (transformers' defaults).
_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def gemma_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ArchConfig's fields from a Gemma ``config.json`` (``architecture`` is ``gemma2`` or ``gemma3``).

    The file is flattened to the Llama family's keys, read as those are, and
    Gemma's own fields are added; Gemma 3 norms each q and k head.
    """
    flat, own = _split(config)
    return {**llama_style_fields(flat, architecture), **own, "qk_norm": architecture == "gemma3"}


def _split(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config`` flattened to the keys every family shares, and the Gemma-only ArchConfig fields.

    The flattened dict holds the global layers' ``rope_theta`` and
    ``rope_scaling`` and no ``sliding_window`` or ``rope_parameters``; the
    fields dict holds ``sliding_window``, ``layer_types``,
    ``query_pre_attn_scalar``, the soft caps, ``rope_local_base_freq`` and
    ``hidden_act``.
    """
    model_type = config.get("model_type")
    if model_type == "gemma3":
        config = _text_part(config)
        model_type = "gemma3_text"
    defaults = _DEFAULTS[str(model_type)]
    config = {**defaults, **config}
    for key, default in defaults.items():
        # A null takes the default, as a missing key does, except where null means "off".
        if config[key] is None and key not in _NULL_MEANS_OFF:
            config[key] = default
    activation = config["hidden_activation"]
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"hidden_activation is {activation!r}; Gemma models run gelu_pytorch_tanh only",
            field="hidden_activation",
        )
    if config["attention_bias"] is not False:
        raise ModelLoadError(
            "attention_bias must be false for Gemma models", field="attention_bias"
        )
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(
            "use_bidirectional_attention is set: that is an embedding model, not a causal LM",
            field="use_bidirectional_attention",
        )
    global_rope, local_rope = _rope(config, str(model_type))
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None and isinstance(num_layers, int):
        pattern = config.get("sliding_window_pattern", _SLIDING_PATTERN[str(model_type)])
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelLoadError(
                f"sliding_window_pattern is {pattern!r}; it must be a positive integer",
                field="sliding_window_pattern",
            )
        layer_types = [
            "full_attention" if (index + 1) % pattern == 0 else "sliding_attention"
            for index in range(num_layers)
        ]
    fields = {
        "sliding_window": config["sliding_window"],
        "layer_types": tuple(layer_types) if isinstance(layer_types, list) else layer_types,
        "query_pre_attn_scalar": config["query_pre_attn_scalar"],
        # transformers' Gemma 3 attention never applies attn_logit_softcapping; nor do we.
        "attn_logit_softcapping": config["attn_logit_softcapping"]
        if model_type == "gemma2"
        else None,
        "final_logit_softcapping": config["final_logit_softcapping"],
        "rope_local_base_freq": local_rope,
        "hidden_act": activation,  # GeGLU's GELU, the only one Gemma runs (checked above)
    }
    flat = {k: v for k, v in config.items() if k not in ("sliding_window", "rope_parameters")}
    flat["rope_theta"], flat["rope_scaling"] = global_rope
    return flat, fields


def _text_part(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal Gemma 3 ``config.json``."""
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ModelLoadError(f"text_config is {text!r}; it must be an object", field="text_config")
    # Token ids and tying are often given at the top level only.
    inherited = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings")
        if key in config and key not in text
    }
    return {**inherited, **text, "model_type": "gemma3_text"}


def _rope(
    config: dict[str, Any], model_type: str
) -> tuple[tuple[Any, dict[str, Any] | None], float | None]:
    """((global theta, global scaling or None), local theta or None) of ``config``."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(
            f"rope_parameters is {params!r}; it must be an object", field="rope_parameters"
        )
    params = params or {}
    nested = "full_attention" in params or "sliding_attention" in params
    global_params = (params.get("full_attention") or {}) if nested else params
    scaling = config.get("rope_scaling")
    if global_params.get("rope_type", global_params.get("type", "default")) != "default":
        scaling = global_params
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    theta = global_params.get("rope_theta", config["rope_theta"])
    if model_type == "gemma2":
        return (theta, scaling), None
    local_params = (params.get("sliding_attention") or {}) if nested else {}
    local_type = local_params.get("rope_type", local_params.get("type", "default"))
    if local_type != "default":
        raise ModelLoadError(
            f"rope_parameters.sliding_attention has rope_type {local_type!r}; the sliding "
            "layers of Gemma 3 support the default RoPE only",
            field="rope_parameters",
        )
    local_theta = local_params.get("rope_theta", config["rope_local_base_freq"])
    return (theta, scaling), local_theta
