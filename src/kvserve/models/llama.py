"""The Llama family: Llama, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Differences between them are flags on :class:`ArchConfig`. The model runs on
one flat stream of tokens with explicit positions and attention metadata;
q/k/v and gate/up projections are fused into single matrix products.

Under tensor parallelism (``tp.size > 1``) each rank holds ``1/size`` of the
attention heads (q/k/v split by head, ``o_proj`` by input column) and of the
MLP's columns (gate/up split, ``down_proj`` by input column); the two
row-parallel projections each end in an all-reduce, two per block (see
``layers/parallel_linear.py``). Embeddings, norms and the LM head are
replicated on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import Attention
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.norm import RMSNorm
from kvserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from kvserve.layers.rotary import RotaryEmbedding, RotaryQK, apply_rotary
from kvserve.models.arch_config import ArchConfig
from kvserve.models.causal_lm import CausalLM
from kvserve.models.decoder_model import DecoderLayerLayout
from kvserve.models.weight_loader import WeightTarget


class LlamaAttention(nn.Module):
    """q/k/v (fused), RoPE, paged attention, output projection; Gemma's attention too.

    Everything that differs between the families is read from ``arch`` for
    layer ``layer_index``: q/k/v biases (Qwen2), q/k norms (Qwen3, Gemma 3), the
    layer's sliding window, the score scale (``query_pre_attn_scalar``,
    Gemma), soft-capped scores (Gemma 2) and which RoPE table rotates q and k.

    With ``tp.size`` ranks, this rank runs ``1/size`` of the q heads and of the
    KV heads (``num_heads`` and ``num_kv_heads`` are the rank's).
    """

    def __init__(
        self,
        arch: ArchConfig,
        layer_index: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads // tp.size
        self.num_kv_heads = arch.num_key_value_heads // tp.size
        self.head_dim = arch.head_dim
        q_size = arch.num_attention_heads * self.head_dim
        kv_size = arch.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            arch.hidden_size,
            tp=tp,
            shards={"q": q_size, "k": kv_size, "v": kv_size},
            bias=arch.attention_bias,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(q_size, arch.hidden_size, tp=tp, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.rotary = RotaryQK(self.num_heads, self.num_kv_heads, self.head_dim)
        window = arch.layer_sliding_window(layer_index)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            (arch.query_pre_attn_scalar or self.head_dim) ** -0.5,
            backend,
            sliding_window=window,
            logits_soft_cap=arch.attn_logit_softcapping,
        )
        # Which of the decoder's RoPE tables this layer rotates by: Gemma 3's sliding
        # layers have their own (local) one.
        self.rope_table = 1 if window is not None and arch.rope_local_base_freq is not None else 0

    def forward(
        self, rope: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """rope: ``[T, 2, D]`` cosines and sines of the tokens' positions."""
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv_flat = self.qkv_proj(hidden)
        # [T, Hq + 2 Hkv, D]: the heads of q, then k, then v.
        qkv = qkv_flat.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, num_qk_heads:]
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rotary(self.q_norm(qkv[:, : self.num_heads]), rope)
            k = apply_rotary(self.k_norm(qkv[:, self.num_heads : num_qk_heads]), rope)
        else:
            q, k = self.rotary(qkv_flat, rope)
        out = self.attn(q, k, v, attn_metadata)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))`` with gate and up fused: SwiGLU
    (``SiluAndMul``, the default) or GeGLU (``GeluAndMul``, Gemma). With
    ``tp.size`` ranks, this rank holds ``1/size`` of the intermediate columns."""

    def __init__(
        self,
        arch: ArchConfig,
        dtype: torch.dtype,
        act: nn.Module | None = None,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            arch.hidden_size, tp=tp, shards={"gate": size, "up": size}, dtype=dtype
        )
        self.down_proj = RowParallelLinear(size, arch.hidden_size, tp=tp, dtype=dtype)
        self.act = act if act is not None else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        layer_index: int,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(arch, layer_index, dtype, backend, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(arch, dtype, tp=tp)

    def forward(
        self,
        rope: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pre-norm block on the residual stream.

        The previous block's output is added to the stream here, together with
        the norm that follows (one pass); ``residual`` is None for the first
        block, whose input is the stream itself. Returns the block's output and
        the stream, which the next block (or the final norm) adds together.
        """
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = self.self_attn(rope, normed, attn_metadata)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual

    def decode_layout(self) -> DecoderLayerLayout:
        """This layer's parts for the native decode stack (see ``models/decoder_model.py``)."""
        attention = self.self_attn
        return DecoderLayerLayout(
            input_norm=self.input_layernorm,
            qkv=attention.qkv_proj,
            q_norm=attention.q_norm,
            k_norm=attention.k_norm,
            attention=attention.attn,
            o_proj=attention.o_proj,
            mlp_norm=self.post_attention_layernorm,
            up=self.mlp.gate_up_proj,
            act=self.mlp.act,
            down=self.mlp.down_proj,
            rope_table=attention.rope_table,
        )


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, backend, index, tp)
            for index in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions)  # looked up once, shared by every layer
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, attn_metadata)
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]

    # The DecoderModel interface (models/decoder_model.py).
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]``; positions are unused (RoPE rotates q and k)."""
        return self.embed_tokens(input_ids)

    def rope_tables(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """The one ``[T, 2, D]`` cos/sin table every layer rotates by."""
        return [self.rotary_emb(positions)]

    def decoder_layers(self) -> Sequence[nn.Module]:
        return list(self.layers)

    def final_norm(self) -> RMSNorm:
        return self.norm


# Checkpoint name → (our parameter name, group of the shard of a fused layer); Gemma's too.
_FUSED_SHARDS = [
    (re.compile(r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\3", 2),
    (re.compile(r"(.*)\.mlp\.(gate|up)_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 2),
]


def fused_weight_target(name: str) -> WeightTarget:
    """Where checkpoint tensor ``name`` goes in a model whose q/k/v and gate/up
    projections are fused (Llama's and Gemma's): its shard of the fused layer,
    or the parameter of the same name."""
    for pattern, replacement, shard_group in _FUSED_SHARDS:
        match = pattern.match(name)
        if match:
            return WeightTarget(pattern.sub(replacement, name), match.group(shard_group))
    return WeightTarget(name)


class LlamaForCausalLM(CausalLM):
    """The Llama decoder under ``model.`` plus the LM head (see :class:`CausalLM`)."""

    model: LlamaModel

    def __init__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        decoder = LlamaModel(arch, max_position, dtype, backend, tp)
        super().__init__(arch, "model", decoder, decoder.embed_tokens, dtype, tp)

    def weight_target(self, name: str) -> WeightTarget:
        return fused_weight_target(name)
