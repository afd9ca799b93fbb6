"""The CPU fast path: C kernels in the layers, and decode-only steps in one C call.

Models describe their architecture with the shared layers and never mention
the kernels. After loading, the worker calls :func:`enable_native_kernels`,
which hands the kernels to every layer that can use them (linear products,
norms, rotary embeddings, activations), and builds a :class:`NativeDecoder`
when the model's decoder layers have the shape the one-call kernel walks
(pre-norm attention with fused q/k/v and a SwiGLU MLP: the Llama family).

A decode-only step (one token per sequence, no prefill chunk) then runs every
decoder layer in ``kv_llama_decode_layers``: at batch 1 the Python between
thirty layers' calls cost more than a tenth of the step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from kvserve.attention import AttentionMetadata, NativePagedAttention
from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.bounds import check_kv_pool
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import Attention
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryQK

_Part = TypeVar("_Part", bound=nn.Module)


def enable_native_kernels(model: nn.Module, ops: NativeOps | None = None) -> int:
    """Hand the C kernels to every layer that can use them; returns how many took them.

    For float32 activations on CPU (the weights may be bfloat16). Does nothing
    (returns 0) when the kernels are unavailable.
    """
    ops = ops if ops is not None else native_ops()
    if ops is None:
        return 0
    count = 0
    for module in model.modules():
        takes_kernels = isinstance(module, RMSNorm | SiluAndMul | RotaryQK) or (
            isinstance(module, Linear) and not module.packed
        )
        if takes_kernels:
            setattr(module, "native", ops)  # noqa: B010  (mypy: nn.Module's __setattr__)
            count += 1
    return count


@dataclass(frozen=True)
class DecodeLayerWeights:
    """A decoder layer's weight addresses and shapes, read once when the kernels are enabled.

    norms: (input norm, post-attention norm) weight pointers; linears: (qkv,
    qkv bias or None, o_proj, gate_up, down) pointers; weight_dtype: the linear
    weights' dtype (float32 or bfloat16); hidden_size: the width of the rows
    the weights multiply (the kernel trusts the hidden states to match it).
    The tensors must outlive this record.
    """

    norms: tuple[int, int]
    linears: tuple[int, int | None, int, int, int]
    weight_dtype: torch.dtype
    hidden_size: int
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    scale: float


class _KvDecodeLayer(ctypes.Structure):
    """``KvDecodeLayer`` in ``kernels.h``."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "o_proj",
            "gate_up",
            "down",
            "qkv_bias",
            "key_cache",
            "value_cache",
        )
    ]


class DecodeStack:
    """A model's decoder layers as the one-call decode kernel reads them.

    Built once from each layer's :class:`DecodeLayerWeights` and its slice of the
    KV pool (``[2, num_blocks, block_size, Hkv, D]``, float32 or bfloat16,
    contiguous); the weight and cache tensors must outlive it. Every layer must
    share shapes, norm epsilon, attention scale, weight dtype and pool dtype.
    """

    def __init__(self, layers: list[DecodeLayerWeights], kv_caches: list[torch.Tensor]) -> None:
        if not layers or len(layers) != len(kv_caches):
            raise ValueError("a decode stack needs one KV cache per layer, and at least one layer")
        first = layers[0]
        shared = (
            "weight_dtype",
            "hidden_size",
            "eps",
            "scale",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        )
        for layer in layers[1:]:
            for name in shared:
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
        # Every layer's pool has these: the block ids and slots of a step are checked against them.
        self.num_blocks = int(kv_caches[0].shape[1])
        self.block_size = int(kv_caches[0].shape[2])
        self.kv_bf16 = kv_caches[0].dtype == torch.bfloat16
        self.layers = (_KvDecodeLayer * len(layers))(
            *(
                _KvDecodeLayer(
                    *layer.norms,
                    layer.linears[0],
                    *layer.linears[2:],
                    layer.linears[1],
                    cache[0].data_ptr(),
                    cache[1].data_ptr(),
                )
                for layer, cache in zip(layers, kv_caches, strict=True)
            )
        )


def _part(module: object, path: str, kind: type[_Part]) -> _Part | None:
    """``module.<path>`` (dotted) when it exists and is a ``kind``, else None."""
    for name in path.split("."):
        module = getattr(module, name, None)
    return module if isinstance(module, kind) else None


def read_decode_layer(layer: nn.Module) -> DecodeLayerWeights | None:
    """What the one-call kernel needs of a Llama-shaped decoder layer, or None.

    The layer must be pre-norm attention (``input_layernorm``, ``self_attn``
    with a fused ``qkv_proj``, ``o_proj``, no q/k norms, no sliding window or
    soft cap, on the native attention backend) followed by ``post_attention_layernorm`` and a SwiGLU
    ``mlp`` (``gate_up_proj``, ``act``, ``down_proj``), with float32 norms and
    float32 or bfloat16 linear weights, unpacked, biases on q/k/v only.
    """
    input_norm = _part(layer, "input_layernorm", RMSNorm)
    post_norm = _part(layer, "post_attention_layernorm", RMSNorm)
    attention = _part(layer, "self_attn.attn", Attention)
    qkv = _part(layer, "self_attn.qkv_proj", Linear)
    o_proj = _part(layer, "self_attn.o_proj", Linear)
    gate_up = _part(layer, "mlp.gate_up_proj", Linear)
    down = _part(layer, "mlp.down_proj", Linear)
    if (
        input_norm is None
        or post_norm is None
        or attention is None
        or qkv is None
        or o_proj is None
        or gate_up is None
        or down is None
    ):
        return None
    linears = (qkv, o_proj, gate_up, down)
    weight_dtypes = {linear.weight.dtype for linear in linears}
    if (
        _part(layer, "self_attn.q_norm", nn.Module) is not None
        or _part(layer, "mlp.act", SiluAndMul) is None
        or not isinstance(attention.backend, NativePagedAttention)
        # The one-call kernel attends over every key, unscaled by a soft cap.
        or attention.sliding_window is not None
        or attention.logits_soft_cap is not None
        or any(linear.packed for linear in linears)
        or any(linear.bias is not None for linear in linears[1:])
        or len(weight_dtypes) != 1
        or not weight_dtypes <= {torch.float32, torch.bfloat16}
        or {input_norm.weight.dtype, post_norm.weight.dtype} != {torch.float32}
    ):
        return None
    return DecodeLayerWeights(
        norms=(input_norm.weight.data_ptr(), post_norm.weight.data_ptr()),
        linears=(
            qkv.weight.data_ptr(),
            None if qkv.bias is None else qkv.bias.data_ptr(),
            o_proj.weight.data_ptr(),
            gate_up.weight.data_ptr(),
            down.weight.data_ptr(),
        ),
        weight_dtype=weight_dtypes.pop(),
        hidden_size=qkv.in_features,
        eps=input_norm.eps,
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        intermediate_size=down.in_features,
        scale=attention.scale,
    )


class NativeDecoder:
    """Runs a decode-only step's decoder layers in one C call.

    decoder: the model's decoder (``embed_tokens``, ``rotary_emb``, ``layers``,
    ``norm``), after its KV caches are bound. Build it with :meth:`for_model`,
    which returns None when the layers do not have the shape the kernel walks.
    """

    def __init__(self, decoder: Any, stack: DecodeStack, ops: NativeOps) -> None:
        self.decoder = decoder
        self.stack = stack
        self.ops = ops

    @classmethod
    def for_model(cls, model: nn.Module, ops: NativeOps | None = None) -> NativeDecoder | None:
        ops = ops if ops is not None else native_ops()
        decoder: Any = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if ops is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            return None
        if not isinstance(getattr(decoder, "norm", None), RMSNorm):
            return None
        weights = [read_decode_layer(layer) for layer in layers]
        attentions = [_part(layer, "self_attn.attn", Attention) for layer in layers]
        caches = [a.kv_cache for a in attentions if a is not None and a.kv_cache.numel()]
        readable = [w for w in weights if w is not None]
        if len(readable) != len(layers) or len(caches) != len(layers):
            return None
        stack = DecodeStack(readable, caches)
        return cls(decoder, stack, ops)

    def applies(self, attn_metadata: AttentionMetadata) -> bool:
        """The step has decode rows only."""
        return not attn_metadata.prefills

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` of decode rows → final hidden states ``[T, H]``."""
        hidden = self.decoder.embed_tokens(input_ids).float().contiguous()
        rope = self.decoder.rotary_emb(positions)
        # hidden becomes the residual stream, updated in place.
        out = self.ops.llama_decode_layers(
            self.stack,
            hidden,
            rope,
            attn_metadata.slot_mapping,
            attn_metadata.decode_block_tables,
            attn_metadata.decode_seq_lens,
        )
        return self.decoder.norm.add_and_norm(out, hidden)[0]
