"""The CPU plan: kvserve's C kernels wherever they build, PyTorch's operators elsewhere.

Three precisions: the linear weights', the activations' and the KV pool's.
Wherever the C kernels build, activations are float32 and the kernels
multiply bf16 weights with them; without the kernels the model computes in
its weights' dtype (bf16 only on CPUs with bf16 units, whose weights are then
pre-packed for oneDNN: see ``worker/cpu_weights.py``).

Decode-only steps run their decoder layers in one C call
(:class:`~kvserve.worker.native_decode.NativeDecoder`) where every layer has
a shape the kernel walks, with the native paged attention, on one rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

from kvserve.config import EngineConfig
from kvserve.config.dtype import resolve_dtype_name
from kvserve.distributed.group import TensorParallelGroup
from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.huge_pages import huge_pages_wanted
from kvserve.kernels.quant_ops import MANY_ROWS_ENV
from kvserve.kernels.quant_weight import X8_TYPES, QuantSegment, QuantWeight
from kvserve.kernels.tuning import (
    BlasChoice,
    ManyRowsChoice,
    TuningCache,
    first_layer,
    record_environment_choice,
    stream_bytes,
    tune_f32_blas_rows,
    tune_quant_many_rows,
    tune_stream_prefetch,
    tune_x8_wide,
    tuning_enabled,
)
from kvserve.layers.activation import GELU, GeluAndMul, SiluAndMul
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.linear import Linear
from kvserve.layers.norm import LayerNorm, RMSNorm
from kvserve.layers.rotary import RotaryQK
from kvserve.layers.weight_format import KernelF32Weights, QuantizedWeights, set_f32_blas_rows
from kvserve.loader.repacked_cache import RepackedCache
from kvserve.models.arch_config import ArchConfig
from kvserve.models.bert import BertSelfAttention
from kvserve.models.families import FAMILIES
from kvserve.worker.cpu_weights import (
    can_prepack,
    move_weights_to_huge_pages,
    prepack_linear_weights,
    store_linear_weights_in_bf16,
    use_linear_kernels,
)
from kvserve.worker.native_decode import NativeDecoder
from kvserve.worker.platform.plan import (
    AttentionPlan,
    DecodeFastPath,
    FastPathInputs,
    WeightPrecision,
    plan_attention,
)

# The shared layers besides Linear that call a C kernel when they are given one (``native``).
_TAKES_KERNELS = (
    RMSNorm,
    LayerNorm,
    SiluAndMul,
    GELU,
    GeluAndMul,
    RotaryQK,
    VocabEmbedding,
    BertSelfAttention,
)


def tuning_cache(ops: NativeOps) -> TuningCache:
    """The kernel choices measured for the loaded library, kept beside it."""
    return TuningCache.for_library(Path(ops.lib._name))


def tune_quantized_kernels(model: nn.Module, ops: NativeOps) -> ManyRowsChoice | None:
    """Choose where the quantized kernels switch to their many-row path, on this machine and
    at this thread count, from the model's first layer (``kernels/tuning.py``); None for a
    model without quantized weights or with tuning turned off."""
    named = [
        (name, module.format.qweight)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and isinstance(module.format, QuantizedWeights)
    ]
    threads = torch.get_num_threads()
    if not named:
        return None
    if os.environ.get(MANY_ROWS_ENV, "").strip():
        return record_environment_choice(ops.quant_many_rows, threads)
    if not tuning_enabled():
        return None
    cache = tuning_cache(ops)
    layer = first_layer(named)
    if any(s.qtype in X8_TYPES for _, weight in named for s in weight.segments):
        tune_stream_prefetch(
            lambda x, weight: ops.linear_quant(x, weight, None),
            ops.set_quant_stream_nta,
            lambda: q8_0_stream(ops),
            cache,
            threads,
        )
        block32 = [w for w in layer if all(s.qtype in X8_TYPES for s in w.segments)]
        if ops.x8_wide_built and block32:
            tune_x8_wide(
                lambda x, weight: ops.linear_quant(x, weight, None),
                ops.set_quant_x8_wide_rows,
                block32,
                cache,
                threads,
            )
    return tune_quant_many_rows(
        lambda x, weight: ops.linear_quant(x, weight, None),
        ops.set_quant_many_rows,
        layer,
        cache,
        threads,
    )


def tune_float_kernels(model: nn.Module, ops: NativeOps) -> BlasChoice | None:
    """Choose from how many rows float32 weights go to BLAS rather than the C kernel, on
    this machine and at this thread count, from the model's first layer
    (``kernels/tuning.py``); None for a model without float32 weights on the kernels or
    with tuning turned off."""
    named = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and isinstance(module.format, KernelF32Weights)
    ]
    if not named or not tuning_enabled():
        return None
    layer = first_layer(named)
    signature = ",".join(f"{m.out_features}x{m.in_features}" for m in layer)
    with torch.inference_mode():
        return tune_f32_blas_rows(
            lambda x, module: module(x),
            set_f32_blas_rows,
            layer,
            signature,
            tuning_cache(ops),
            torch.get_num_threads(),
        )


def q8_0_stream(ops: NativeOps, in_features: int = 2048) -> QuantWeight:
    """A Q8_0 weight of :func:`stream_bytes` in the layout these kernels multiply (its
    values all zero: the kernels' work and bytes are the same whatever they hold).

    Zero bytes are the same in either layout, so the stream is made in the kernels'
    layout directly rather than laid out from a GGUF copy: one buffer of four times
    the L3 (written, so that it is real memory, not the kernel's shared zero page)
    instead of two at the server's first start."""
    row_bytes = in_features // 32 * 34
    rows = stream_bytes() // row_bytes // 8 * 8
    repacked = GGMLQuantizationType.Q8_0 in ops.repack_layouts
    data = torch.zeros(rows, row_bytes, dtype=torch.uint8)
    segment = QuantSegment(GGMLQuantizationType.Q8_0, rows, data, repacked=repacked)
    return QuantWeight(in_features, [segment])


class CpuPlan:
    """The device decisions of a CPU run. ops: kvserve's C kernels, None where they do not build."""

    def __init__(self, config: EngineConfig, tp: TensorParallelGroup) -> None:
        self.device = torch.device("cpu")
        self.config = config
        self.tp = tp
        self.ops: NativeOps | None = native_ops()
        self.weights = self._precision(encoder=False)
        # quantization='auto' keeps a GGUF file's quantized tensors as stored, multiplied by
        # the C kernels (or, where they do not build, by PyTorch on a dequantized copy).
        # Not over tensor-parallel ranks: a row-parallel layer would cut through blocks.
        self.keep_quantized = config.model_config.quantization == "auto" and tp.size == 1

    def _precision(self, encoder: bool) -> WeightPrecision:
        """The weights' dtype (``auto`` resolved for this machine and kind of model) and
        the activations' (float32 under the C kernels)."""
        weight_dtype = getattr(
            torch,
            resolve_dtype_name(
                self.config.model_config.dtype, native_kernels=self.ops is not None, encoder=encoder
            ),
        )
        return WeightPrecision(
            weight_dtype, torch.float32 if self.ops is not None else weight_dtype
        )

    def attention(self, arch: ArchConfig, max_model_len: int) -> AttentionPlan:
        # The model is known from here: an encoder may resolve ``auto`` differently.
        family = FAMILIES.get(arch.architecture)
        self.weights = self._precision(encoder=family is not None and family.encoder)
        return plan_attention(self.config, self.device, self.weights, arch, self.tp, max_model_len)

    def prepare_weights(self, model: nn.Module, repacked: RepackedCache | None = None) -> None:
        """Pre-pack bf16 weights for oneDNN (CPUs with bf16 units, without the C kernels), or
        store them in bf16 for the kernels and give every shared layer that can use a kernel
        the kernels (a Linear's weight format, the other layers' ``native``): the one place
        the layers are handed them. Quantized layers keep their blocks either way; where the
        kernels repack a type, its segments come from ``repacked`` (the model's cache entry)
        when it has them, and go into it when it does not. Then the weights the kernels
        stream move onto huge pages, where the kernel gives them (``kernels/huge_pages.py``)."""
        weight_dtype, dtype = self.weights
        if can_prepack(dtype, self.device):
            prepack_linear_weights(model)
            return
        if self.ops is None:
            return
        if weight_dtype == torch.bfloat16:
            store_linear_weights_in_bf16(model)
        layouts = self.ops.repack_layouts
        if repacked is not None and layouts:
            repacked.open(layouts)
        else:
            repacked = None
        use_linear_kernels(model, self.ops, repacked)
        for name, module in model.named_modules():
            if isinstance(module, _TAKES_KERNELS):
                setattr(module, "native", self.ops)  # noqa: B010  (mypy: nn.Module's __setattr__)
            if isinstance(module, VocabEmbedding) and module.qweight is not None:
                segments = None if repacked is None else repacked.for_weight(name)
                module.qweight = self.ops.kernel_layout(module.qweight, segments)
        if repacked is not None:
            repacked.finish()
        if huge_pages_wanted():
            move_weights_to_huge_pages(model)
        tune_quantized_kernels(model, self.ops)
        tune_float_kernels(model, self.ops)

    def decode_fast_path(self, inputs: FastPathInputs) -> DecodeFastPath | None:
        """The one-call decoder, on one rank (tensor parallelism all-reduces between layers).

        It walks layers on the native paged attention only: with another backend
        (FlexAttention, PyTorch's), ``for_model`` finds no layer it can walk.
        """
        if self.ops is None or self.tp.size > 1:
            return None
        return NativeDecoder.for_model(inputs.model, self.ops)

    def argmax_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.ops.argmax_rows if self.ops is not None else None

    def wait_for_device(self) -> float:
        """Nothing to wait for: CPU work is done when the call returns."""
        return 0.0
