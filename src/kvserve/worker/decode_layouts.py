"""Where each model family keeps the parts of a decoder layer, and reading them.

The one-call decode kernel walks one layer shape (see :mod:`decode_stack`).
Models do not describe themselves to it: this module knows the families'
layouts (which module is the norm before attention, which the fused qkv
projection, ...) and reads a layer's weights through whichever layout
accounts for every weighted module the layer has. A layer with a part no
layout knows, or a part of a kind the kernel lacks, keeps the per-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.attention import NativePagedAttention
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import Attention
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.worker.decode_stack import ActKind, DecodeLayerWeights, NormKind


@dataclass(frozen=True)
class LayerLayout:
    """Dotted module paths of a family's decoder-layer parts (None: the family lacks it).

    up: the fused gate and up projection of a gated MLP, or the up projection
    alone. mlp_norm: the norm before the MLP. attn_out_norm, mlp_out_norm:
    norms applied to the attention's and the MLP's outputs before they join
    the residual stream.
    """

    input_norm: str
    qkv: str
    o_proj: str
    attention: str
    mlp_norm: str
    up: str
    act: str
    down: str
    attn_out_norm: str | None = None
    mlp_out_norm: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    rope: bool = True

    def paths(self) -> list[str]:
        optional = (self.attn_out_norm, self.mlp_out_norm, self.q_norm, self.k_norm)
        required = [self.input_norm, self.qkv, self.o_proj, self.attention, self.mlp_norm]
        return [*required, self.up, self.act, self.down, *(p for p in optional if p)]


# Tried in order; the first that accounts for every weighted module of a layer is used.
LAYOUTS = (
    # Gemma 2 and 3: norms around both blocks, q/k norms on Gemma 3.
    LayerLayout(
        input_norm="input_layernorm",
        qkv="self_attn.qkv_proj",
        o_proj="self_attn.o_proj",
        attention="self_attn.attn",
        mlp_norm="pre_feedforward_layernorm",
        up="mlp.gate_up_proj",
        act="mlp.act",
        down="mlp.down_proj",
        attn_out_norm="post_attention_layernorm",
        mlp_out_norm="post_feedforward_layernorm",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
    ),
    # Llama, Mistral, Qwen2, Qwen3 (q/k norms).
    LayerLayout(
        input_norm="input_layernorm",
        qkv="self_attn.qkv_proj",
        o_proj="self_attn.o_proj",
        attention="self_attn.attn",
        mlp_norm="post_attention_layernorm",
        up="mlp.gate_up_proj",
        act="mlp.act",
        down="mlp.down_proj",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
    ),
    # GPT-2: learned positions instead of RoPE, biases everywhere.
    LayerLayout(
        input_norm="ln_1",
        qkv="attn.c_attn",
        o_proj="attn.c_proj",
        attention="attn.attn",
        mlp_norm="ln_2",
        up="mlp.c_fc",
        act="mlp.act",
        down="mlp.c_proj",
        rope=False,
    ),
)


def part(module: nn.Module, path: str | None) -> nn.Module | None:
    """``module.<path>`` (dotted) when it exists and is a module, else None."""
    if path is None:
        return None
    found: object = module
    for name in path.split("."):
        found = getattr(found, name, None)
    return found if isinstance(found, nn.Module) else None


def _pointer(tensor: object) -> int | None:
    """The address of a tensor, None for anything else (a missing part or bias)."""
    return tensor.data_ptr() if isinstance(tensor, torch.Tensor) else None


def _weight(module: nn.Module | None) -> int | None:
    return None if module is None else _pointer(getattr(module, "weight", None))


def _norm_kind(norm: nn.Module) -> NormKind | None:
    if isinstance(norm, RMSNorm):
        return NormKind.RMS
    if type(norm).__name__ == "LayerNorm" and hasattr(norm, "bias"):
        return NormKind.LAYER
    return None


def _act_kind(act: nn.Module) -> ActKind | None:
    if isinstance(act, SiluAndMul):
        return ActKind.SILU_MUL
    # GELU with the tanh approximation, gated (Gemma) or not (GPT-2).
    if getattr(act, "approximate", None) == "tanh":
        return ActKind.GELU_TANH_MUL if getattr(act, "gated", False) else ActKind.GELU_TANH
    return None


def _accounts_for_every_weight(layer: nn.Module, layout: LayerLayout) -> bool:
    named = [p for p in layout.paths() if part(layer, p) is not None]
    covered = {name for path in named for name, _ in part(layer, path).named_parameters(path)}  # type: ignore[union-attr]
    return {name for name, _ in layer.named_parameters()} <= covered


def read_decode_layer(layer: nn.Module) -> DecodeLayerWeights | None:
    """What the one-call kernel needs of a decoder layer, or None when it cannot walk it."""
    for layout in LAYOUTS:
        if _accounts_for_every_weight(layer, layout):
            weights = _read(layer, layout)
            if weights is not None:
                return weights
    return None


def _read(layer: nn.Module, layout: LayerLayout) -> DecodeLayerWeights | None:
    input_norm, mlp_norm = part(layer, layout.input_norm), part(layer, layout.mlp_norm)
    attention = part(layer, layout.attention)
    attention_owner = part(layer, layout.attention.rpartition(".")[0])
    linears = [part(layer, p) for p in (layout.qkv, layout.o_proj, layout.up, layout.down)]
    act = part(layer, layout.act)
    if (
        input_norm is None
        or mlp_norm is None
        or act is None
        or not isinstance(attention, Attention)
        or not isinstance(attention.backend, NativePagedAttention)
        or not all(isinstance(linear, Linear) and not linear.packed for linear in linears)
    ):
        return None
    qkv, o_proj, up, down = (linear for linear in linears if isinstance(linear, Linear))
    extra_norms = [part(layer, p) for p in (layout.attn_out_norm, layout.mlp_out_norm)]
    qk_norms = [part(layer, p) for p in (layout.q_norm, layout.k_norm)]
    norms = [input_norm, mlp_norm, *(n for n in extra_norms if n is not None)]
    norm_kinds = {_norm_kind(n) for n in norms}
    act_kind = _act_kind(act)
    weight_dtypes = {linear.weight.dtype for linear in (qkv, o_proj, up, down)}
    eps_values = {getattr(n, "eps", None) for n in [*norms, *(n for n in qk_norms if n)]}
    if (
        len(norm_kinds) != 1
        or None in norm_kinds
        or act_kind is None
        or any(n is not None and not isinstance(n, RMSNorm) for n in qk_norms)
        or (qk_norms[0] is None) != (qk_norms[1] is None)
        or len(weight_dtypes) != 1
        or not weight_dtypes <= {torch.float32, torch.bfloat16}
        or len(eps_values) != 1
        or any(p.dtype != torch.float32 for n in norms for p in n.parameters())
    ):
        return None
    norm_kind = norm_kinds.pop()
    assert norm_kind is not None
    rope_table = getattr(attention_owner, "rope_table", 0) if layout.rope else None
    input_weight, mlp_weight = _weight(input_norm), _weight(mlp_norm)
    assert input_weight is not None and mlp_weight is not None
    return DecodeLayerWeights(
        norms=(input_weight, mlp_weight),
        linears=(
            qkv.weight.data_ptr(),
            o_proj.weight.data_ptr(),
            up.weight.data_ptr(),
            down.weight.data_ptr(),
        ),
        weight_dtype=weight_dtypes.pop(),
        hidden_size=qkv.in_features,
        eps=float(eps_values.pop()),  # type: ignore[arg-type]
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        intermediate_size=down.in_features,
        scale=attention.scale,
        norm_kind=norm_kind,
        act_kind=act_kind,
        norm_biases=(
            _pointer(getattr(input_norm, "bias", None)),
            _pointer(getattr(mlp_norm, "bias", None)),
        ),
        out_norms=(_weight(extra_norms[0]), _weight(extra_norms[1])),
        qk_norms=(_weight(qk_norms[0]), _weight(qk_norms[1])),
        biases=(_pointer(qkv.bias), _pointer(o_proj.bias), _pointer(up.bias), _pointer(down.bias)),
        rope_table=rope_table,
        kv_group=getattr(attention, "kv_group", 0),
        sliding_window=attention.sliding_window,
        soft_cap=attention.logits_soft_cap,
    )
