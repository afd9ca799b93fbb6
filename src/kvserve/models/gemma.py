"""Gemma 2 and Gemma 3 (text): Llama's skeleton with Gemma's own touches.

- the token embeddings are scaled by ``sqrt(hidden_size)``;
- RMSNorm multiplies by ``1 + w``: the 1 is added to the weights when they
  are loaded, so the shared :class:`RMSNorm` (and its C kernel) applies;
- every attention and MLP output is normed again before it joins the
  residual stream (four norms per layer);
- the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
- layers alternate between sliding-window and global attention
  (``ArchConfig.layer_types``);
- Gemma 2 soft-caps attention scores and the final logits
  (``cap * tanh(x / cap)``);
- Gemma 3 norms each q and k head (as Qwen3) and gives its sliding layers a
  RoPE base of their own (``rope_local_base_freq``, never scaled).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.layers.activation import GeluAndMul
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.arch_config import ArchConfig
from kvserve.models.causal_lm import CausalLM, CheckpointTensor
from kvserve.models.decoder_model import DecoderLayerLayout
from kvserve.models.llama import LlamaAttention, LlamaMLP, fused_weight_target
from kvserve.models.weight_loader import WeightTarget


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        layer_index: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = LlamaAttention(arch, layer_index, dtype, backend, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = LlamaMLP(arch, dtype, GeluAndMul(), tp)  # GeGLU
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(
        self,
        rope: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block: norm, attention, norm, add; norm, MLP, norm (added by the next block).

        As in Llama's layer, the previous block's output joins the stream
        together with this block's first norm; ``residual`` is None for the
        first block. Returns the block's normed MLP output and the stream.
        """
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = self.post_attention_layernorm(self.self_attn(rope, normed, attn_metadata))
        normed, residual = self.pre_feedforward_layernorm.add_and_norm(attn_out, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual

    def decode_layout(self) -> DecoderLayerLayout:
        """This layer's parts for the native decode stack: four norms, q/k norms on Gemma 3."""
        attention = self.self_attn
        return DecoderLayerLayout(
            input_norm=self.input_layernorm,
            qkv=attention.qkv_proj,
            q_norm=attention.q_norm,
            k_norm=attention.k_norm,
            attention=attention.attn,
            o_proj=attention.o_proj,
            attn_out_norm=self.post_attention_layernorm,
            mlp_norm=self.pre_feedforward_layernorm,
            up=self.mlp.gate_up_proj,
            act=self.mlp.act,
            down=self.mlp.down_proj,
            mlp_out_norm=self.post_feedforward_layernorm,
            rope_table=attention.rope_table,
        )


class GemmaModel(nn.Module):
    embed_scale: torch.Tensor

    def __init__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype), freeze=True
        )
        # sqrt(hidden_size) rounded to the embeddings' dtype, as transformers rounds it.
        self.register_buffer(
            "embed_scale", torch.tensor(arch.hidden_size**0.5, dtype=dtype), persistent=False
        )
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling, dtype
        )
        self.rotary_emb_local = (
            None
            if arch.rope_local_base_freq is None
            else RotaryEmbedding(
                arch.head_dim, max_position, arch.rope_local_base_freq, None, dtype
            )
        )
        layers = [
            GemmaDecoderLayer(arch, index, dtype, backend, tp)
            for index in range(arch.num_hidden_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.layer_rope_tables = tuple(layer.self_attn.rope_table for layer in layers)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]``, scaled by ``sqrt(hidden_size)``; positions are unused."""
        return self.embed_tokens(input_ids) * self.embed_scale

    def rope_tables(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """``[T, 2, D]`` cos/sin per table: the global one, then Gemma 3's local one."""
        tables = [self.rotary_emb(positions)]
        if self.rotary_emb_local is not None:
            tables.append(self.rotary_emb_local(positions))
        return tables

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed(input_ids, positions)
        # Each table is looked up once per step and shared by the layers that use it.
        tables = self.rope_tables(positions)
        residual: torch.Tensor | None = None
        for layer, table in zip(self.layers, self.layer_rope_tables, strict=True):
            hidden, residual = layer(tables[table], hidden, residual, attn_metadata)
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]

    # With embed and rope_tables above, the DecoderModel interface (models/decoder_model.py).
    def decoder_layers(self) -> Sequence[nn.Module]:
        return list(self.layers)

    def final_norm(self) -> RMSNorm:
        return self.norm


# Multimodal Gemma 3 checkpoints: the language model's prefixes (transformers 5's, then
# older ones) and the vision parts, which a text-only model does not use.
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class GemmaForCausalLM(CausalLM):
    """The Gemma decoder under ``model.`` plus the LM head (see :class:`CausalLM`).

    Checkpoint norm weights arrive as offsets from 1 and are stored with the 1
    added; a multimodal Gemma 3 checkpoint loads its language model only.
    """

    model: GemmaModel

    def __init__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        decoder = GemmaModel(arch, max_position, dtype, backend, tp)
        super().__init__(arch, "model", decoder, decoder.embed_tokens, dtype, tp)

    def checkpoint_tensors(self, weights: Iterable[CheckpointTensor]) -> Iterator[CheckpointTensor]:
        """The language model's tensors under text-only names, norms as ``1 + w``."""
        for name, tensor in weights:
            if name.startswith(_VISION_PREFIXES):
                continue
            for prefix, replacement in _TEXT_PREFIXES.items():
                if name.startswith(prefix):
                    name = replacement + name.removeprefix(prefix)
                    break
            if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
                # In float32, as transformers computes 1 + w whatever the weights' dtype.
                tensor = tensor.float() + 1.0
            yield name, tensor

    def weight_target(self, name: str) -> WeightTarget:
        return fused_weight_target(name)
