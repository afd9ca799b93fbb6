"""What a decoder-only model offers the worker's fast paths, so the worker never guesses.

The one-call decode stack (``kernels/decode_stack.py``) walks one layer shape:

    input_norm → qkv → [q_norm, k_norm] → RoPE → paged attention → o_proj
        → [attn_out_norm] → + residual
    → mlp_norm → up → act → down → [mlp_out_norm] → + residual

A decoder layer declares which of its modules plays each part
(:class:`DecoderLayerLayout`, from :meth:`DecoderLayer.decode_layout`); the
decoder around the layers offers its embedding, its RoPE tables, its layers
and its final norm (:class:`DecoderModel`). The worker reads weights,
kinds and switches from these modules' shared classes (``layers/``); whether
the kernel can walk a layer (its dtypes, its attention backend, ...) is the
worker's to decide. Nothing here is device-specific.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.layers.attention import Attention
from kvserve.layers.linear import Linear
from kvserve.layers.norm import LayerNorm, RMSNorm


@dataclass(frozen=True)
class DecoderLayerLayout:
    """A decoder layer's modules in the parts of the one shape above (None: it lacks that part).

    input_norm, mlp_norm: the norms before attention and before the MLP;
    attn_out_norm, mlp_out_norm: norms of the attention's and the MLP's outputs
    before they join the residual stream; q_norm, k_norm: per-head norms of q
    and k. qkv: the fused q/k/v projection (rows: q heads, k heads, v heads);
    up: the fused gate and up projection of a gated MLP, or the up projection
    alone; act: the MLP's activation between ``up`` and ``down``. attention:
    the paged attention layer (its heads, scale, sliding window, soft cap and
    KV cache group). rope_table: which of :meth:`DecoderModel.rope_tables`
    rotates q and k; None: the layer uses no RoPE.
    """

    input_norm: RMSNorm | LayerNorm
    qkv: Linear
    attention: Attention
    o_proj: Linear
    mlp_norm: RMSNorm | LayerNorm
    up: Linear
    act: nn.Module
    down: Linear
    rope_table: int | None
    attn_out_norm: RMSNorm | LayerNorm | None = None
    mlp_out_norm: RMSNorm | LayerNorm | None = None
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def modules(self) -> list[nn.Module]:
        """Every module the layout names: together they must hold all of the layer's weights."""
        optional = (self.attn_out_norm, self.mlp_out_norm, self.q_norm, self.k_norm)
        required: list[nn.Module] = [
            self.input_norm,
            self.qkv,
            self.attention,
            self.o_proj,
            self.mlp_norm,
            self.up,
            self.act,
            self.down,
        ]
        return [*required, *(module for module in optional if module is not None)]


@runtime_checkable
class DecoderLayer(Protocol):
    """A decoder layer that declares its parts for the native stack."""

    def decode_layout(self) -> DecoderLayerLayout:
        """This layer's modules, each in its part of the stack's layer shape."""
        ...


@runtime_checkable
class DecoderModel(Protocol):
    """The decoder of a causal LM: embedding, RoPE tables, decoder layers, final norm.

    Its forward pass is ``final_norm().add_and_norm(out, residual)`` after the
    layers, which run on ``embed(...)`` with the tables ``rope_tables(...)``.
    """

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions ``[T]`` → the residual stream's first value ``[T, H]``."""
        ...

    def rope_tables(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """``[T, 2, D]`` cos/sin per RoPE table (the layers index them); empty without RoPE."""
        ...

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers in order; the native stack takes them when each is a
        :class:`DecoderLayer`."""
        ...

    def final_norm(self) -> RMSNorm | LayerNorm:
        """The norm after the last layer, which adds the last output to the stream."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The whole decoder: input_ids, positions ``[T]`` → hidden states ``[T, H]``."""
        ...


@runtime_checkable
class HasDecoder(Protocol):
    """A causal LM whose decoder the fast paths may walk."""

    def decoder(self) -> DecoderModel:
        """The decoder inside the model (the LM head stays with the model's ``compute_logits``)."""
        ...
