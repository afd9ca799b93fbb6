"""How a :class:`~kvserve.layers.linear.Linear` stores and multiplies its weight.

Each layer holds one format object, chosen once: at load (a GGUF tensor kept
in its quantized blocks) and when the device plan hands the layers their
kernels (``worker/platform/cpu.py``). ``Linear.forward`` only calls
``format.apply``, so the model code never asks how a weight is stored, and
the one-call decode stack asks the format what to hand the C kernel
(:meth:`WeightFormat.decode_weight`) instead of guessing from dtypes.

The formats:

- :class:`TorchWeights`: PyTorch's ``F.linear`` on the float ``weight``, any
  dtype, any device. Every layer starts here.
- :class:`KernelF32Weights`, :class:`KernelBF16Weights`: kvserve's C kernels
  on a float32 or bfloat16 ``weight`` with float32 activations (bf16 weights
  are widened as they stream, or multiplied with AVX512-BF16 dot products:
  ``NativeOps.bf16_dot`` picks).
- :class:`PackedBF16Weights`: a bf16 ``weight`` pre-packed in oneDNN's blocked
  layout, for CPUs with bf16 units where the C kernels do not build.
- :class:`QuantizedWeights`: GGUF's quantized blocks (a :class:`QuantWeight`);
  the float ``weight`` parameter is then an empty placeholder.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from kvserve.kernels.quant_weight import QuantWeight
from kvserve.kernels.weight_kind import WeightKind

if TYPE_CHECKING:
    from kvserve.kernels import NativeOps
    from kvserve.kernels.quant_ops import RepackedSegments
    from kvserve.layers.linear import Linear

# Up to this many rows the C kernel beats BLAS on float32 weights (measured on an
# AVX2 EPYC: 1.7x at one row, 2.9x at 4, 1.3x at 64, 1.2x at 256, even at 1024). That
# is a property of the core: on an Ice Lake BLAS is 1.5-2x faster from 64 rows. So the
# CPU plan times both on the model's first layer and sets the crossover it measured
# (``kernels/tuning.py``, :func:`set_f32_blas_rows`); this is the default without it.
# bfloat16 weights with float32 rows always take the C kernels (see ops.linear).
NATIVE_MAX_ROWS = 512
_blas_rows = NATIVE_MAX_ROWS + 1


def set_f32_blas_rows(rows: int) -> None:
    """float32 weights go to BLAS from ``rows`` rows of activations (the C kernel below)."""
    global _blas_rows
    _blas_rows = max(int(rows), 1)


def f32_blas_rows() -> int:
    """The row count from which float32 weights go to BLAS."""
    return _blas_rows


class DecodeWeight(NamedTuple):
    """A linear weight as the one-call decode kernel takes it (``KvDecodeLayer.weight_kinds``).

    pointer: the weight's address (a ``const KvQuantWeight *`` for
    ``WeightKind.QUANT``); owner: what holds that memory, kept alive with the stack.
    """

    kind: WeightKind
    pointer: int
    owner: object


class WeightFormat(ABC):
    """How one layer's weight is stored and multiplied.

    loadable: checkpoint tensors may still be copied into the layer's float
    ``weight`` (False once it is packed or replaced by quantized blocks).
    """

    loadable = False

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x W^T (+ b)`` for ``x`` ``[..., in_features]``."""

    def with_kernels(
        self, layer: Linear, ops: NativeOps, repacked: RepackedSegments | None = None
    ) -> WeightFormat:
        """This format once the C kernels serve the layer (itself where they cannot).

        repacked: where quantized blocks already in the kernels' layout are kept
        (``QuantOps.kernel_layout``); the other formats ignore it.
        """
        return self

    def decode_weight(self, layer: Linear) -> DecodeWeight | None:
        """What the one-call decode kernel reads, or None where it cannot multiply this format."""
        return None

    def nbytes(self, layer: Linear) -> int:
        """Bytes the layer's weight holds (its float parameter, or its quantized blocks)."""
        return layer.weight.numel() * layer.weight.element_size()


class TorchWeights(WeightFormat):
    """PyTorch's ``F.linear`` on the float weight: any dtype, any device."""

    loadable = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def with_kernels(
        self, layer: Linear, ops: NativeOps, repacked: RepackedSegments | None = None
    ) -> WeightFormat:
        if layer.weight.dtype == torch.float32:
            return KernelF32Weights(ops)
        if layer.weight.dtype == torch.bfloat16:
            return KernelBF16Weights(ops)
        return self


class _KernelWeights(WeightFormat):
    """The C linear kernels on a float weight of :attr:`dtype`, float32 activations."""

    loadable = True
    dtype: torch.dtype

    def __init__(self, ops: NativeOps) -> None:
        self.ops = ops

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # Small products go to the kernel; so do all of bf16 weights with float32 inputs
        # (BLAS has no bf16 x float32 product). Large float32 ones go to BLAS.
        if x.dim() == 2 and (x.shape[0] < _blas_rows or layer.weight.dtype != x.dtype):
            return self.ops.linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def decode_weight(self, layer: Linear) -> DecodeWeight | None:
        weight = layer.weight
        if weight.dtype != self.dtype or not weight.is_contiguous():
            return None
        return DecodeWeight(self.ops.weight_kind(self.dtype), weight.data_ptr(), weight)


class KernelF32Weights(_KernelWeights):
    """float32 weights: the C kernel below :func:`f32_blas_rows` rows, BLAS from there."""

    dtype = torch.float32


class KernelBF16Weights(_KernelWeights):
    """bfloat16 weights with float32 activations: always the C kernel (widening or
    AVX512-BF16 dot products, as ``ops.bf16_dot`` says), half the bytes of float32."""

    dtype = torch.bfloat16


class PackedBF16Weights(WeightFormat):
    """A bf16 weight in oneDNN's blocked layout (see ``worker/cpu_weights.py``).

    The weight is then only meaningful to oneDNN's packed matmul: neither the C
    kernels nor a checkpoint copy can use it.
    """

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")


class QuantizedWeights(WeightFormat):
    """GGUF's quantized blocks, multiplied as stored by ``NativeOps.linear_quant``.

    qweight: the layer's ``[out_features, in_features]`` weight in segments of
    rows (a fused layer may mix types); ops: the C kernels, None until the
    plan hands them over (or where they do not build).
    """

    def __init__(self, qweight: QuantWeight, ops: NativeOps | None = None) -> None:
        self.qweight = qweight
        self.ops = ops
        self._dense: torch.Tensor | None = None

    def _kernel(self) -> bool:
        return self.ops is not None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dtype == torch.float32:
            rows = x.reshape(-1, x.shape[-1])
            out = self.ops.linear_quant(rows, self.qweight, layer.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return self._fallback(layer, x)

    def _fallback(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The fallback path for machines without the quantized kernels (and for
        activations they do not take): PyTorch on a float32 copy of the weight, made
        on first use and kept. It computes the kernels' product without rounding the
        activations to int8, at eight times the memory of a 4-bit weight."""
        if self._dense is None:
            self._dense = self.qweight.dequantize().to(x.device)
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(x.float(), self._dense, bias).to(x.dtype)

    def with_kernels(
        self, layer: Linear, ops: NativeOps, repacked: RepackedSegments | None = None
    ) -> WeightFormat:
        return QuantizedWeights(ops.kernel_layout(self.qweight, repacked), ops)

    def decode_weight(self, layer: Linear) -> DecodeWeight | None:
        if not self._kernel():
            return None
        return DecodeWeight(WeightKind.QUANT, ctypes.addressof(self.qweight.struct), self.qweight)

    def nbytes(self, layer: Linear) -> int:
        return self.qweight.nbytes
