"""The ranges a model's hyperparameters must fall in, and the checks that enforce them.

A config.json or GGUF header is input like any other: a zero head count
divides by zero, a negative size fails deep inside PyTorch, a vocabulary of
2^40 tokens asks for terabytes. The bounds below are wide enough for every
released model of the families kvserve runs (the largest known value is in
the comment) and narrow enough to stop absurd values before anything is
allocated. They bound each number on its own; that the weights the numbers
describe fit in the model's files is checked by
:func:`kvserve.loader.model_size.check_weights_fit_files`.
"""

from __future__ import annotations

import math
from typing import Any

from kvserve.errors import ModelLoadError

# ArchConfig field → inclusive (low, high).
ARCH_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),  # 262,144 (Gemma 3)
    "hidden_size": (1, 1 << 16),  # 16,384 (Llama 3.1 405B)
    "intermediate_size": (1, 1 << 20),  # 53,248 (Llama 3.1 405B)
    # Zero is allowed: the model code runs a model without layers (embedding, norm, head).
    "num_hidden_layers": (0, 1024),  # 126 (Llama 3.1 405B)
    "num_attention_heads": (1, 1024),  # 128 (Llama 3.1 405B)
    "num_key_value_heads": (1, 1024),  # 128 (Llama 2 7B)
    "head_dim": (2, 1024),  # 256 (Gemma)
    "max_position_embeddings": (1, 1 << 24),  # 10,485,760 (Llama 4 Scout)
    # Optional (None: no sliding layers); a window past the context is simply never reached.
    "sliding_window": (1, 1 << 24),  # 4,096 (Gemma 2)
}

# transformers' names for the attention of a layer (``layer_types``).
LAYER_TYPES = ("full_attention", "sliding_attention")


def checked_int(value: Any, limits_of: str, field: str, prefix: str = "") -> int:
    """``value`` if it is an int within ``ARCH_LIMITS[limits_of]``; else ModelLoadError naming ``field``.

    Booleans and floats are refused, even integral ones: every format kvserve
    reads stores these numbers as integers, so anything else is a corrupt file.
    ``prefix`` says where ``field`` lives (``"GGUF metadata "``) in the message.
    """
    name = prefix + field
    if value is None:
        raise ModelLoadError(f"{name} is missing", field=field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{name} is {value!r}; it must be an integer", field=field)
    low, high = ARCH_LIMITS[limits_of]
    if not low <= value <= high:
        raise ModelLoadError(f"{name} is {value}; it must be between {low} and {high}", field=field)
    return value


def checked_positive_float(
    value: Any, field: str, below: float = math.inf, prefix: str = ""
) -> float:
    """``value`` as a float if it is a finite number in ``(0, below)``; else ModelLoadError."""
    name = prefix + field
    if value is None:
        raise ModelLoadError(f"{name} is missing", field=field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{name} is {value!r}; it must be a number", field=field)
    number = float(value)
    if not (math.isfinite(number) and 0.0 < number < below):
        bound = "" if below == math.inf else f" and below {below}"
        raise ModelLoadError(f"{name} is {value}; it must be positive{bound}", field=field)
    return number


def checked_bool(value: Any, field: str) -> bool:
    """``value`` if it is a bool (JSON true/false); ModelLoadError otherwise."""
    if not isinstance(value, bool):
        raise ModelLoadError(f"{field} is {value!r}; it must be true or false", field=field)
    return value


def checked_token_id(value: Any, field: str) -> int:
    """A token id: any int (an id outside the vocabulary never matches a sampled token)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{field} is {value!r}; it must be an integer token id", field=field)
    return value


def check_rope_scaling(scaling: Any, field: str = "rope_scaling") -> None:
    """Refuse a ``rope_scaling`` dict whose numbers would divide by zero or go non-finite.

    Its type is checked when the model is built (unsupported ones are refused
    there); here only the shape of the dict and the numbers the supported
    types compute with.
    """
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{field} is {scaling!r}; it must be an object", field=field)
    for key, value in scaling.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            checked_positive_float(value, f"{field}.{key}")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if not isinstance(rope_type, str):
        raise ModelLoadError(
            f"{field}.rope_type is {rope_type!r}; it must be a string", field=field
        )
    required = {
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }.get(rope_type, ())
    for key in required:
        checked_positive_float(scaling.get(key), f"{field}.{key}")
    # llama3 interpolates between the two: equal values divide by zero.
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelLoadError(
            f"{field}.high_freq_factor must be above low_freq_factor, got "
            f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}",
            field=f"{field}.high_freq_factor",
        )


def check_layer_types(
    layer_types: Any, num_layers: int, sliding_window: int | None, field: str = "layer_types"
) -> None:
    """Refuse per-layer attention types that are not one known name per layer.

    A sliding layer needs a window to slide: ``sliding_window`` must then be set.
    """
    if layer_types is None:
        return
    if not isinstance(layer_types, list | tuple) or len(layer_types) != num_layers:
        raise ModelLoadError(
            f"{field} must list one attention type per layer ({num_layers}), got {layer_types!r}",
            field=field,
        )
    for layer_type in layer_types:
        if layer_type not in LAYER_TYPES:
            raise ModelLoadError(
                f"{field} holds {layer_type!r}; each entry must be one of {', '.join(LAYER_TYPES)}",
                field=field,
            )
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ModelLoadError(
            f"{field} has sliding_attention layers but sliding_window is not set",
            field="sliding_window",
        )


def token_ids_of(config: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """``bos_token_id`` and the ``eos_token_id`` list (one id or a list of them in config.json)."""
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return config.get("bos_token_id"), eos_ids
