"""Reading a decoder layer's declared layout into what the one-call decode kernel walks.

Each decoder layer names its parts itself (``decode_layout()``, see
``models/decoder_model.py``); this module turns them into a
:class:`~kvserve.kernels.decode_stack.DecodeLayerWeights` record of weight
addresses and switches, reading only the shared layer classes (``layers/``).
A layer whose layout leaves a weighted module out, or has a part of a kind or
dtype the kernel lacks, keeps the per-layer path. Each linear's weight format
says how the kernel reads it (its kind and address), so one layer may mix
quantized and float projections.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import NativePagedAttention
from kvserve.kernels.decode_stack import ActKind, DecodeLayerWeights, NormKind
from kvserve.layers.activation import GELU, GeluAndMul, SiluAndMul
from kvserve.layers.linear import Linear
from kvserve.layers.norm import LayerNorm, RMSNorm
from kvserve.models.decoder_model import DecoderLayer, DecoderLayerLayout


def _pointer(tensor: torch.Tensor | None) -> int | None:
    """The address of a tensor, None for a missing part or bias."""
    return None if tensor is None else tensor.data_ptr()


def _weight(norm: RMSNorm | LayerNorm | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _bias(norm: RMSNorm | LayerNorm) -> int | None:
    """A LayerNorm's bias; RMSNorm has none."""
    return norm.bias.data_ptr() if isinstance(norm, LayerNorm) else None


def _norm_kind(norm: RMSNorm | LayerNorm) -> NormKind:
    return NormKind.RMS if isinstance(norm, RMSNorm) else NormKind.LAYER


def _act_kind(act: nn.Module) -> ActKind | None:
    if isinstance(act, SiluAndMul):
        return ActKind.SILU_MUL
    # GELU with the tanh approximation, gated (GeGLU) or not.
    if isinstance(act, GeluAndMul):
        return ActKind.GELU_TANH_MUL
    if isinstance(act, GELU) and act.approximate == "tanh":
        return ActKind.GELU_TANH
    return None


def _accounts_for_every_weight(layer: nn.Module, layout: DecoderLayerLayout) -> bool:
    """The declared parts hold every parameter of the layer (nothing the kernel would skip)."""
    covered = {id(p) for module in layout.modules() for p in module.parameters()}
    return all(id(p) in covered for p in layer.parameters())


def read_decode_layer(layer: nn.Module) -> DecodeLayerWeights | None:
    """What the one-call kernel needs of a decoder layer, or None when it cannot walk it."""
    if not isinstance(layer, DecoderLayer):
        return None
    layout = layer.decode_layout()
    if not _accounts_for_every_weight(layer, layout):
        return None
    attention = layout.attention
    linears = (layout.qkv, layout.o_proj, layout.up, layout.down)
    act_kind = _act_kind(layout.act)
    if (
        not isinstance(attention.backend, NativePagedAttention)
        or any(not isinstance(linear, Linear) for linear in linears)
        or act_kind is None
    ):
        return None
    qkv, o_proj, up, down = linears
    # A packed weight, or a quantized one without the quantized kernels, has none.
    decode_weights = [linear.format.decode_weight(linear) for linear in linears]
    norms = [layout.input_norm, layout.mlp_norm]
    norms += [n for n in (layout.attn_out_norm, layout.mlp_out_norm) if n is not None]
    qk_norms = (layout.q_norm, layout.k_norm)
    norm_kinds = {_norm_kind(n) for n in norms}
    eps_values = {n.eps for n in [*norms, *(n for n in qk_norms if n is not None)]}
    if (
        len(norm_kinds) != 1
        or (qk_norms[0] is None) != (qk_norms[1] is None)
        or any(w is None for w in decode_weights)
        or len(eps_values) != 1
        or any(p.dtype != torch.float32 for n in norms for p in n.parameters())
    ):
        return None
    w_qkv, w_o, w_up, w_down = (w for w in decode_weights if w is not None)
    input_norm, mlp_norm = layout.input_norm, layout.mlp_norm
    return DecodeLayerWeights(
        norms=(input_norm.weight.data_ptr(), mlp_norm.weight.data_ptr()),
        linears=(w_qkv.pointer, w_o.pointer, w_up.pointer, w_down.pointer),
        weight_kinds=(w_qkv.kind, w_o.kind, w_up.kind, w_down.kind),
        weight_owners=(w_qkv.owner, w_o.owner, w_up.owner, w_down.owner),
        hidden_size=qkv.in_features,
        eps=float(eps_values.pop()),
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        intermediate_size=down.in_features,
        scale=attention.scale,
        norm_kind=norm_kinds.pop(),
        act_kind=act_kind,
        norm_biases=(_bias(input_norm), _bias(mlp_norm)),
        out_norms=(_weight(layout.attn_out_norm), _weight(layout.mlp_out_norm)),
        qk_norms=(_weight(qk_norms[0]), _weight(qk_norms[1])),
        biases=(_pointer(qkv.bias), _pointer(o_proj.bias), _pointer(up.bias), _pointer(down.bias)),
        rope_table=layout.rope_table,
        kv_group=attention.kv_group,
        sliding_window=attention.sliding_window,
        soft_cap=attention.logits_soft_cap,
    )
