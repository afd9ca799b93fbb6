"""A model's decoder layers as the one-call decode kernel reads them: the C struct layout.

``kv_decode_layers`` (kernels/csrc/decoder_layer.c) walks one layer shape: a
pre-norm attention block and a pre-norm MLP block on a residual stream. What
differs between models is switched on per layer: LayerNorm biases, norms after
attention and after the MLP, per-head q/k norms, biases on every projection,
RoPE or none and which table, sliding windows, soft-capped scores, and the
MLP's activation. :class:`DecodeLayerWeights` holds one layer's weight
addresses and switches; :class:`DecodeStack` packs them for the kernel, in the
``KvDecodeLayer`` struct of ``kernels.h``, with the layer's slice of the KV
pool. Which module of a model is which part is the model's to declare
(``models/decoder_model.py``); the worker reads it into these records.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from kvserve.kernels.bounds import check_kv_pool
from kvserve.kernels.weight_kind import WeightKind


class NormKind(IntEnum):
    """The norm every layer of a stack uses (``KV_NORM_*`` in kernels.h)."""

    RMS = 0
    LAYER = 1


class ActKind(IntEnum):
    """The MLP's activation (``KV_ACT_*``): gated SiLU, gated GELU-tanh, or GELU-tanh alone."""

    SILU_MUL = 0
    GELU_TANH_MUL = 1
    GELU_TANH = 2


@dataclass(frozen=True)
class DecodeLayerWeights:
    """A decoder layer's weight addresses and switches, read once when the kernels are enabled.

    norms: (before attention, before the MLP) weight pointers; norm_biases:
    their LayerNorm biases; out_norms: (after attention, after the MLP) norm
    weights; qk_norms: per-head q and k norm weights; linears: (qkv,
    o_proj, gate_up, down) weight pointers, gate_up being the up projection
    alone for an ungated activation; weight_kinds: how each is stored (its own
    kind each: a GGUF file may quantize some and not others); weight_owners: what
    holds each weight's memory (a quantized weight's ``KvQuantWeight``), kept
    alive by the stack; biases: theirs. Optional parts are None. hidden_size:
    the width of the rows the weights multiply (the kernel trusts the hidden
    states to match it). rope_table: which of the step's RoPE tables rotates
    q and k (None: no RoPE); kv_group: which of the step's block tables and
    slot mappings its KV cache group uses. The tensors must outlive this record.
    """

    norms: tuple[int, int]
    linears: tuple[int, int, int, int]
    weight_kinds: tuple[WeightKind, WeightKind, WeightKind, WeightKind]
    hidden_size: int
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    scale: float
    norm_kind: NormKind = NormKind.RMS
    act_kind: ActKind = ActKind.SILU_MUL
    norm_biases: tuple[int | None, int | None] = (None, None)
    out_norms: tuple[int | None, int | None] = (None, None)
    qk_norms: tuple[int | None, int | None] = (None, None)
    biases: tuple[int | None, int | None, int | None, int | None] = (None, None, None, None)
    rope_table: int | None = 0
    kv_group: int = 0
    sliding_window: int | None = None
    soft_cap: float | None = None
    weight_owners: tuple[object, ...] = field(default=(), compare=False, repr=False)


# What every layer of a stack must agree on (the kernel takes them once per call).
SHARED_FIELDS = (
    "hidden_size",
    "eps",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "norm_kind",
    "act_kind",
)


class _KvDecodeLayer(ctypes.Structure):
    """``KvDecodeLayer`` in ``kernels.h``."""

    _fields_ = [
        *(
            (name, ctypes.c_void_p)
            for name in (
                "input_norm",
                "input_norm_bias",
                "post_norm",
                "post_norm_bias",
                "attn_out_norm",
                "mlp_out_norm",
                "q_norm",
                "k_norm",
                "qkv",
                "o_proj",
                "gate_up",
                "down",
                "qkv_bias",
                "o_bias",
                "gate_up_bias",
                "down_bias",
                "key_cache",
                "value_cache",
            )
        ),
        ("kv_group", ctypes.c_int64),
        ("rope_table", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("weight_kinds", ctypes.c_int64 * 4),
        ("scale", ctypes.c_float),
        ("soft_cap", ctypes.c_float),
    ]


def _pack(layer: DecodeLayerWeights, cache: torch.Tensor) -> _KvDecodeLayer:
    return _KvDecodeLayer(
        *layer.norms[:1],
        layer.norm_biases[0],
        layer.norms[1],
        layer.norm_biases[1],
        *layer.out_norms,
        *layer.qk_norms,
        *layer.linears,
        *layer.biases,
        cache[0].data_ptr(),
        cache[1].data_ptr(),
        layer.kv_group,
        -1 if layer.rope_table is None else layer.rope_table,
        layer.sliding_window or 0,
        (ctypes.c_int64 * 4)(*(int(kind) for kind in layer.weight_kinds)),
        layer.scale,
        layer.soft_cap or 0.0,
    )


class DecodeStack:
    """A model's decoder layers as the one-call decode kernel reads them.

    Built once from each layer's :class:`DecodeLayerWeights` and its slice of the
    KV pool (``[2, num_blocks, block_size, Hkv, D]``, float32 or bfloat16,
    contiguous); the weight and cache tensors must outlive it. Every layer must
    share the :data:`SHARED_FIELDS`, the pool's dtype, block size and size;
    scale, window, soft cap, RoPE table and how each linear weight is stored may
    differ per layer.
    """

    def __init__(self, layers: list[DecodeLayerWeights], kv_caches: list[torch.Tensor]) -> None:
        if not layers or len(layers) != len(kv_caches):
            raise ValueError("a decode stack needs one KV cache per layer, and at least one layer")
        first = layers[0]
        for layer in layers[1:]:
            for name in SHARED_FIELDS:
                if getattr(layer, name) != getattr(first, name):
                    raise ValueError(f"the decoder layers differ in {name}")
        for cache in kv_caches:
            check_kv_pool(cache)
            # The kernel strides through the pool by the layers' head shapes, not the cache's.
            if tuple(cache.shape[3:]) != (first.num_kv_heads, first.head_dim):
                raise ValueError("a KV cache's heads differ from its decoder layer's")
        if len({cache.shape[2] for cache in kv_caches}) != 1:
            raise ValueError("the decoder layers' KV caches differ in block size")
        if len({cache.shape[1] for cache in kv_caches}) != 1:
            raise ValueError("the decoder layers' KV caches differ in number of blocks")
        if len({cache.dtype for cache in kv_caches}) != 1:
            raise ValueError("the decoder layers' KV caches differ in dtype")
        self.shape = first  # its shared fields hold for every layer
        # The RoPE tables a step must pass: one more than the highest index a layer uses.
        self.num_rope_tables = 1 + max(
            (layer.rope_table for layer in layers if layer.rope_table is not None), default=-1
        )
        self.num_kv_groups = 1 + max(layer.kv_group for layer in layers)
        # Every layer's pool has these: the block ids and slots of a step are checked against them.
        self.num_blocks = int(kv_caches[0].shape[1])
        self.block_size = int(kv_caches[0].shape[2])
        self.kv_bf16 = kv_caches[0].dtype == torch.bfloat16
        # The kernel reads quantized weights through structs these hold.
        self.weight_owners = [layer.weight_owners for layer in layers]
        self.layers = (_KvDecodeLayer * len(layers))(
            *(_pack(layer, cache) for layer, cache in zip(layers, kv_caches, strict=True))
        )
