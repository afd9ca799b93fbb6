"""The shape of a model: what the loader reads and the model code is built from.

One dataclass covers every architecture (the table of them is
``families.FAMILIES``): the Llama family (Llama, SmolLM2, Mistral, Qwen2,
Qwen3), whose differences are flags (``attention_bias``, ``qk_norm``), Gemma 2
and 3 (optional fields: ``sliding_window``, ``layer_types``, the soft caps) and
GPT-2. Fields a family does not use keep their defaults. It is filled from a
Hugging Face ``config.json`` (by the family's reader, ``<family>_config.py``)
or from GGUF metadata.
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
    checked_int,
    checked_positive_float,
    checked_token_id,
)
from kvserve.models.families import (
    FAMILIES,
    Family,
    architecture_of_model_type,
    check_architecture,
)

# Optional ARCH_LIMITS fields: None means the model does not use them.
_OPTIONAL_LIMITED = ("sliding_window",)


@dataclass(frozen=True)
class ArchConfig:
    """Hyperparameters of a decoder-only transformer.

    architecture: a key of ``families.FAMILIES``: ``llama`` (also Mistral,
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
    type_vocab_size: rows of the token-type (segment) embedding of an encoder
        (BERT); None for decoders, which have none.

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
    type_vocab_size: int | None = None

    def __post_init__(self) -> None:
        # Every way in (config.json, GGUF metadata, the converted-model cache)
        # ends here, so these checks hold for every model that gets built.
        check_architecture(self.architecture)
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
        allowed = ["silu", *gelus] if self.family.gated_mlp else gelus
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
    def family(self) -> Family:
        """What kvserve knows of this architecture (``families.FAMILIES``)."""
        return FAMILIES[self.architecture]

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of layer ``layer_index``, or None when it attends to everything."""
        if self.layer_types is None or self.layer_types[layer_index] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def uses_rope(self) -> bool:
        """Whether attention rotates q and k by position (else positions are learned embeddings)."""
        return not self.family.learned_positions

    def layer_matmul_weights(self) -> int:
        """Weights of one decoder layer's matrix products (q/k/v, output, MLP): biases and
        norms left out. Each costs 2 FLOPs per token."""
        hidden = self.hidden_size
        q_size = self.num_attention_heads * self.head_dim
        qkv_size = q_size + 2 * self.num_key_value_heads * self.head_dim
        # SwiGLU and GeGLU: gate, up and down; GPT-2's MLP: up and down.
        mlp_matrices = 3 if self.family.gated_mlp else 2
        return hidden * qkv_size + q_size * hidden + mlp_matrices * hidden * self.intermediate_size

    def num_parameters(self) -> int:
        """The number of weights the model holds (a tied LM head counted once)."""
        family = self.family
        hidden, head_dim = self.hidden_size, self.head_dim
        qkv_size = (self.num_attention_heads + 2 * self.num_key_value_heads) * head_dim
        norm_size = (2 if family.layer_norm else 1) * hidden  # LayerNorm: a weight and a bias
        embeddings = self.vocab_size * hidden
        if family.learned_positions:
            embeddings += self.max_position_embeddings * hidden  # one row per position
        if self.type_vocab_size is not None:
            embeddings += self.type_vocab_size * hidden  # BERT; its embedding norm is the last term
        mlp_up = (2 if family.gated_mlp else 1) * self.intermediate_size
        per_layer_extra = (
            family.norms_per_layer * norm_size
            + (qkv_size if self.attention_bias else 0)
            # The output projection's bias, then the MLP's (up, gate if any, and down).
            + (hidden + mlp_up + hidden if family.output_biases else 0)
            + (2 * head_dim if self.qk_norm else 0)
        )
        head = 0 if self.tie_word_embeddings or family.encoder else self.vocab_size * hidden
        per_layer = self.layer_matmul_weights() + per_layer_extra
        return embeddings + head + self.num_hidden_layers * per_layer + norm_size

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ArchConfig:
        """Build from a parsed Hugging Face ``config.json``."""
        architecture = architecture_of_model_type(config.get("model_type"))
        try:
            return ArchConfig(**FAMILIES[architecture].read_config(config, architecture))
        except ModelLoadError:
            raise
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json has a bad value: {exc}") from exc
