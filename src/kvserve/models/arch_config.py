"""The shape of a model: what the loader reads and the model code is built from.

One dataclass covers the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3);
the differences are flags (``attention_bias``, ``qk_norm``). It is filled from
a Hugging Face ``config.json`` or from GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.models.arch_limits import (
    ARCH_LIMITS,
    check_rope_scaling,
    checked_bool,
    checked_int,
    checked_positive_float,
    checked_token_id,
)

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
        # Every way in (config.json, GGUF metadata, the converted-model cache)
        # ends here, so these checks hold for every model that gets built.
        if self.architecture not in SUPPORTED_MODEL_TYPES.values():
            raise ModelLoadError(
                f"architecture {self.architecture!r} is not supported", field="architecture"
            )
        for name in ARCH_LIMITS:
            checked_int(getattr(self, name), name, name)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                field="num_key_value_heads",
            )
        if self.head_dim % 2 != 0:
            raise ModelLoadError(
                f"head_dim is {self.head_dim}; RoPE rotates pairs, so it must be even",
                field="head_dim",
            )
        checked_positive_float(self.rms_norm_eps, "rms_norm_eps", below=1.0)
        checked_positive_float(self.rope_theta, "rope_theta")
        check_rope_scaling(self.rope_scaling)
        if self.bos_token_id is not None:
            checked_token_id(self.bos_token_id, "bos_token_id")
        for token_id in self.eos_token_ids:
            checked_token_id(token_id, "eos_token_id")

    def num_parameters(self) -> int:
        """The number of weights the model holds (a tied LM head counted once)."""
        hidden, head_dim = self.hidden_size, self.head_dim
        q_size = self.num_attention_heads * head_dim
        qkv_size = q_size + 2 * self.num_key_value_heads * head_dim
        per_layer = (
            hidden * qkv_size  # q, k, v projections
            + q_size * hidden  # o projection
            + 3 * hidden * self.intermediate_size  # gate, up, down
            + 2 * hidden  # the two norms
            + (qkv_size if self.attention_bias else 0)
            + (2 * head_dim if self.qk_norm else 0)
        )
        embedding = self.vocab_size * hidden
        head = 0 if self.tie_word_embeddings else embedding
        return embedding + head + self.num_hidden_layers * per_layer + hidden

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ArchConfig:
        """Build from a parsed Hugging Face ``config.json``."""
        model_type = config.get("model_type")
        architecture = SUPPORTED_MODEL_TYPES.get(str(model_type))
        if architecture is None:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}",
                field="model_type",
            )

        def integer(key: str, default: Any = None) -> int:
            # config.json keys are ArchConfig's field names, so the limits are found by key.
            return checked_int(config.get(key, default), key, key)

        try:
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
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
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
            max_positions = integer("max_position_embeddings", 2048)
            sliding_window = config.get("sliding_window")
            if sliding_window and config.get("use_sliding_window", True):
                # Within the window, sliding-window attention equals full attention;
                # capping the context keeps every supported sequence exact.
                window = checked_int(sliding_window, "max_position_embeddings", "sliding_window")
                max_positions = min(max_positions, window)
            return cls(
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
                qk_norm=architecture == "qwen3",
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except ModelLoadError:
            raise
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json has a bad value: {exc}") from exc
