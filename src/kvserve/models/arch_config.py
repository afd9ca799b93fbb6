"""The shape of a model: what the loader reads and the model code is built from.

One dataclass covers every architecture (the table of them is
``registry.ARCHITECTURES``): the Llama family (Llama, SmolLM2, Mistral, Qwen2,
Qwen3), whose differences are flags (``attention_bias``, ``qk_norm``), Gemma 2
and 3 (optional fields: ``sliding_window``, ``layer_types``, the soft caps) and
GPT-2. Fields a family does not use keep their defaults. It is filled from a
Hugging Face ``config.json`` or from GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.layers.activation import GELU_APPROXIMATIONS
from kvserve.models.arch_limits import (
    ARCH_LIMITS,
    check_layer_types,
    check_rope_scaling,
    checked_bool,
    checked_int,
    checked_positive_float,
    checked_token_id,
    token_ids_of,
)
from kvserve.models.gemma_config import gemma_hf_config
from kvserve.models.gpt2_config import gpt2_fields

# Architectures that learn position embeddings instead of rotating q and k (RoPE).
_LEARNED_POSITIONS = ("gpt2",)

# Optional ARCH_LIMITS fields: None means the model does not use them.
_OPTIONAL_LIMITED = ("sliding_window",)


@dataclass(frozen=True)
class ArchConfig:
    """Hyperparameters of a decoder-only transformer.

    architecture: a key of ``registry.ARCHITECTURES``: ``llama`` (also Mistral,
        SmolLM2), ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3`` or ``gpt2``.
    head_dim: per-head size; hidden_size // num_attention_heads unless given.
    rms_norm_eps: the epsilon of every norm (LayerNorm's for GPT-2).
    rope_theta: RoPE's base; unused by GPT-2, which learns position embeddings
        for ``max_position_embeddings`` positions.
    rope_scaling: the Hugging Face ``rope_scaling`` dict (``rope_type`` ``llama3``
        is supported) or None.
    attention_bias: q/k/v projections carry a bias (Qwen2).
    qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
    eos_token_ids: every id that ends generation.
    hidden_act: the MLP's activation, by its Hugging Face name: ``silu``
        (SwiGLU, the Llama family) or a GELU (``gelu_new``, ``gelu``, ...; GPT-2;
        ``gelu_pytorch_tanh``, GeGLU, Gemma).
    sliding_window: how many positions (itself included) a token of a sliding
        layer sees; None when no layer slides.
    layer_types: each layer's attention, ``sliding_attention`` or
        ``full_attention`` (transformers' names); None: every layer full.
    query_pre_attn_scalar: attention scores are scaled by its ``-0.5`` power
        (Gemma); None: by ``head_dim ** -0.5``.
    attn_logit_softcapping: attention scores become ``cap * tanh(s / cap)`` (Gemma 2).
    final_logit_softcapping: the same on the output logits (Gemma 2).
    rope_local_base_freq: the RoPE base of sliding layers (Gemma 3), whose
        ``rope_scaling`` is never applied; None: every layer uses ``rope_theta``.

    The RMSNorm weights of Gemma checkpoints are offsets from 1; the model adds
    the 1 when loading, so the shared RMSNorm applies unchanged.
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
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None

    def __post_init__(self) -> None:
        # Every way in (config.json, GGUF metadata, the converted-model cache)
        # ends here, so these checks hold for every model that gets built.
        _registry().check_architecture(self.architecture)
        for name in ARCH_LIMITS:
            if name not in _OPTIONAL_LIMITED or getattr(self, name) is not None:
                checked_int(getattr(self, name), name, name)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                field="num_key_value_heads",
            )
        if self.head_dim % 2 != 0 and self.uses_rope:
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
        gelus = sorted(GELU_APPROXIMATIONS)
        allowed = gelus if self.architecture == "gpt2" else ["silu", *gelus]
        if self.hidden_act not in allowed:
            raise ModelLoadError(
                f"the activation {self.hidden_act!r} is not supported for {self.architecture}; "
                f"supported: {', '.join(allowed)}",
                field="hidden_act",
            )
        check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_base_freq",
        ):
            if getattr(self, name) is not None:
                checked_positive_float(getattr(self, name), name)

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 or 3: scaled embeddings, (1 + w) norms, norms after attention and MLP."""
        return self.architecture in ("gemma2", "gemma3")

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of layer ``layer_index``, or None when it attends to everything."""
        if self.layer_types is None or self.layer_types[layer_index] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def uses_rope(self) -> bool:
        """Whether attention rotates q and k by position (else positions are learned embeddings)."""
        return self.architecture not in _LEARNED_POSITIONS

    def layer_matmul_weights(self) -> int:
        """Weights of one decoder layer's matrix products (q/k/v, output, MLP): biases and
        norms left out. Each costs 2 FLOPs per token."""
        hidden = self.hidden_size
        q_size = self.num_attention_heads * self.head_dim
        qkv_size = q_size + 2 * self.num_key_value_heads * self.head_dim
        # SwiGLU: gate, up and down; GPT-2's MLP: up and down.
        mlp_matrices = 2 if self.architecture == "gpt2" else 3
        return hidden * qkv_size + q_size * hidden + mlp_matrices * hidden * self.intermediate_size

    def num_parameters(self) -> int:
        """The number of weights the model holds (a tied LM head counted once)."""
        hidden, head_dim = self.hidden_size, self.head_dim
        qkv_size = (self.num_attention_heads + 2 * self.num_key_value_heads) * head_dim
        embeddings = self.vocab_size * hidden
        if self.architecture == "gpt2":
            # Every linear layer has a bias; every LayerNorm a weight and a bias; one
            # learned embedding per position.
            per_layer_extra = qkv_size + 2 * hidden + self.intermediate_size + 2 * 2 * hidden
            final_norm = 2 * hidden
            embeddings += self.max_position_embeddings * hidden
        else:
            per_layer_extra = (
                (4 if self.is_gemma else 2) * hidden  # the norms around attention and MLP
                + (qkv_size if self.attention_bias else 0)
                + (2 * head_dim if self.qk_norm else 0)
            )
            final_norm = hidden
        head = 0 if self.tie_word_embeddings else self.vocab_size * hidden
        per_layer = self.layer_matmul_weights() + per_layer_extra
        return embeddings + head + self.num_hidden_layers * per_layer + final_norm

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ArchConfig:
        """Build from a parsed Hugging Face ``config.json``."""
        architecture = _registry().architecture_of_model_type(config.get("model_type"))
        try:
            if architecture == "gpt2":
                return ArchConfig(**gpt2_fields(config))
            return _llama_from_hf_dict(config, architecture)
        except ModelLoadError:
            raise
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json has a bad value: {exc}") from exc


def _registry() -> Any:
    # Imported on use: the registry imports the model classes, which import this module.
    from kvserve.models import registry

    return registry


def _llama_windows(config: dict[str, Any], architecture: str, num_layers: int) -> dict[str, Any]:
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


def _llama_from_hf_dict(config: dict[str, Any], architecture: str) -> ArchConfig:
    """The Llama and Gemma families' config.json, whose keys are ArchConfig's field names."""
    gemma_fields: dict[str, Any] = {}
    if architecture in ("gemma2", "gemma3"):
        # Flattened to the keys read below; the Gemma-only values come separately.
        config, gemma_fields = gemma_hf_config(config)

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
    if not gemma_fields:
        gemma_fields = _llama_windows(config, architecture, integer("num_hidden_layers"))
    bos_token_id, eos_token_ids = token_ids_of(config)
    return ArchConfig(
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
        qk_norm=architecture in ("qwen3", "gemma3"),
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
        **gemma_fields,
    )
