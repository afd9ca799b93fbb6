"""The shape of a model: what the loader reads and the model code is built from.

One dataclass covers the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3);
the differences are flags (``attention_bias``, ``qk_norm``). It is filled from
a Hugging Face ``config.json`` or from GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.errors import ModelLoadError

# Hugging Face ``model_type`` → our architecture name.
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


@dataclass(frozen=True)
class ArchConfig:
    """Hyperparameters of a decoder-only transformer of the Llama family.

    architecture: ``llama`` (also Mistral, SmolLM2), ``qwen2`` or ``qwen3``.
    head_dim: per-head size; hidden_size // num_attention_heads unless given.
    rope_scaling: the Hugging Face ``rope_scaling`` dict (``rope_type`` ``llama3``
        is supported) or None.
    attention_bias: q/k/v projections carry a bias (Qwen2).
    qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3).
    eos_token_ids: every id that ends generation.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ArchConfig:
        """Build from a parsed Hugging Face ``config.json``."""
        model_type = config.get("model_type")
        architecture = SUPPORTED_MODEL_TYPES.get(str(model_type))
        if architecture is None:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        try:
            num_heads = int(config["num_attention_heads"])
            hidden_size = int(config["hidden_size"])
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            rope_scaling = config.get("rope_scaling")
            rope_theta = config.get("rope_theta")
            # transformers 5 moves rope_theta into rope_parameters.
            rope_parameters = config.get("rope_parameters")
            if isinstance(rope_parameters, dict):
                rope_theta = rope_theta or rope_parameters.get("rope_theta")
                if rope_parameters.get("rope_type", "default") != "default":
                    rope_scaling = rope_scaling or rope_parameters
            if (
                isinstance(rope_scaling, dict)
                and rope_scaling.get("rope_type", "default") == "default"
            ):
                rope_scaling = None
            max_positions = int(config.get("max_position_embeddings", 2048))
            sliding_window = config.get("sliding_window")
            if sliding_window and config.get("use_sliding_window", True):
                # Within the window, sliding-window attention equals full attention;
                # capping the context keeps every supported sequence exact.
                max_positions = min(max_positions, int(sliding_window))
            return cls(
                architecture=architecture,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                rope_scaling=rope_scaling,
                attention_bias=bool(config.get("attention_bias", architecture == "qwen2")),
                qk_norm=architecture == "qwen3",
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value: {exc}") from exc
