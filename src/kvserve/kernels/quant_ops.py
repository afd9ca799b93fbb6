"""The wrappers of the quantized-weight kernels (``kernels/csrc/quant.h``).

:class:`QuantOps` is part of :class:`~kvserve.kernels.ops.NativeOps`; it binds
these entry points of the same library. A :class:`QuantWeight` is multiplied
in GGUF's blocks as they are, with the activations rounded to int8 blocks of
32 once per call; from :attr:`QuantOps.quant_many_rows` rows of activations up
(measured on the machine when a quantized model loads, ``kernels/tuning.py``;
:data:`MANY_ROWS_ENV` sets it instead) the weight is instead
dequantized a panel at a time, once per call, and multiplied in bfloat16 (CPUs
with AVX512-BF16) or float32.
"""

from __future__ import annotations

import ctypes
import os

import torch
from gguf import GGMLQuantizationType

from kvserve.errors import InvalidParameterError
from kvserve.kernels.bounds import check_float_tensor
from kvserve.kernels.file_pages import drop_file_pages
from kvserve.kernels.quant_weight import QuantSegment, QuantWeight

_p = ctypes.c_void_p
_i64 = ctypes.c_int64

# The activations are quantized in blocks of this many values, for every type.
ACTIVATION_BLOCK = 32
# Rows of activations from which linear_quant takes the many-row path (a positive
# integer); unset, the kernel's own default.
MANY_ROWS_ENV = "KVSERVE_QUANT_MANY_ROWS"


class QuantOps:
    """Quantized linear layers and embedding rows (bound by :meth:`_bind_quant_ops`)."""

    def _bind_quant_ops(self, lib: ctypes.CDLL) -> None:
        self._linear_quant = lib.kv_linear_quant
        self._linear_quant.argtypes = [_p, _p, _p, _p, _i64, _i64, ctypes.c_int]
        self._linear_quant.restype = ctypes.c_int
        self._dequant_rows = lib.kv_dequant_rows
        self._dequant_rows.argtypes = [_i64, _p, _i64, _p, _i64, _p, ctypes.c_int]
        self._dequant_rows.restype = ctypes.c_int
        self._many_rows = lib.kv_quant_many_rows
        self._many_rows.argtypes = []
        self._many_rows.restype = _i64
        self._repack_q4_k = lib.kv_q4_k_repack_rows
        self._repack_q4_k.argtypes = [_p, _i64, _i64, _p, ctypes.c_int]
        self._repack_q4_k.restype = ctypes.c_int
        self._repacks_q4_k = bool(lib.kv_q4_k_repack_pays())
        self._set_many_rows = lib.kv_quant_set_many_rows
        self._set_many_rows.argtypes = [_i64]
        self._set_many_rows.restype = None
        value = os.environ.get(MANY_ROWS_ENV, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise InvalidParameterError(
                    MANY_ROWS_ENV, f"a whole number of rows, 1 or more, not {value!r}"
                )
            self._set_many_rows(int(value))

    @property
    def quant_many_rows(self) -> int:
        """Rows of ``x`` from which :meth:`linear_quant` dequantizes the weight in panels."""
        return int(self._many_rows())

    def set_quant_many_rows(self, rows: int) -> None:
        """Take the many-row path from ``rows`` rows of ``x`` up (for every user of this
        library: the threshold is the kernels' own)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise InvalidParameterError("rows", f"a whole number, 1 or more, not {rows!r}")
        self._set_many_rows(rows)

    def kernel_layout(self, weight: QuantWeight) -> QuantWeight:
        """``weight`` as these kernels multiply it fastest: its Q4_K segments repacked (a
        copy: the quants of each block reordered, so a dot product sums each sub-block
        in one vector lane and needs no horizontal additions), where this build has that
        path (x86 with AVX2); otherwise ``weight`` itself. The values are the same, and
        so are the products, bit for bit."""
        if not self._repacks_q4_k:
            return weight
        segments, repacked = [], False
        for segment in weight.segments:
            if segment.qtype != GGMLQuantizationType.Q4_K or segment.repacked:
                segments.append(segment)
                continue
            repacked = True
            data = torch.empty_like(segment.data)
            status = self._repack_q4_k(
                segment.data.data_ptr(),
                segment.rows,
                weight.in_features,
                data.data_ptr(),
                torch.get_num_threads(),
            )
            _raise_for(status, "repack_q4_k", weight)
            segments.append(QuantSegment(segment.qtype, segment.rows, data, repacked=True))
            drop_file_pages(segment.data)
        return QuantWeight(weight.in_features, segments) if repacked else weight

    def linear_quant(
        self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` ``[M, K]`` and a quantized ``W`` ``[N, K]``.

        Below :attr:`quant_many_rows` rows, ``x`` is rounded to int8 in blocks of 32
        (each block scaled by its largest magnitude over 127), so each output is within
        half a step of that rounding times the weights' magnitudes of the float product.
        From it up, with AVX512-BF16, ``x`` and the dequantized weight are rounded to
        bfloat16 (a relative 2^-9 each), so each output is within about 2^-8 of the sum
        of ``|x| |w|``; without it the product is float32 throughout. ``bias``: float32
        ``[N]`` or None. Returns float32 ``[M, N]``.
        """
        in_features, out_features = weight.in_features, weight.out_features
        if x.dim() != 2:
            raise ValueError(f"x must be [rows, {in_features}], not shape {tuple(x.shape)}")
        check_float_tensor("x", x, (x.shape[0], in_features))
        if in_features % ACTIVATION_BLOCK:
            raise ValueError(
                f"the quantized kernels take in_features in multiples of {ACTIVATION_BLOCK}, "
                f"not {in_features}"
            )
        if bias is not None:
            check_float_tensor("bias", bias, (out_features,))
            bias = bias.contiguous()
        x = x.contiguous()
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        status = self._linear_quant(
            x.data_ptr(),
            ctypes.addressof(weight.struct),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            in_features,
            torch.get_num_threads(),
        )
        _raise_for(status, "linear_quant", weight)
        return out

    def dequant_rows(self, weight: QuantWeight, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64 ``[R]``) of a single-segment ``weight``, as float32 ``[R, K]``.

        An embedding table's lookup: only the rows asked for are dequantized.
        """
        if len(weight.segments) != 1:
            raise ValueError(
                f"dequant_rows reads a weight of one segment, not {len(weight.segments)}"
            )
        if rows.dtype != torch.int64 or rows.device.type != "cpu" or rows.dim() != 1:
            raise ValueError(
                f"rows must be a 1-D int64 CPU tensor, not {rows.dtype} {tuple(rows.shape)} "
                f"on {rows.device}"
            )
        segment = weight.segments[0]
        if rows.numel():
            lowest, highest = (int(v) for v in torch.aminmax(rows))
            if lowest < 0 or highest >= segment.rows:
                bad = lowest if lowest < 0 else highest
                raise ValueError(f"rows holds {bad}, outside [0, {segment.rows})")
        rows = rows.contiguous()
        out = torch.empty(rows.numel(), weight.in_features, dtype=torch.float32)
        status = self._dequant_rows(
            segment.kernel_type,
            segment.data.data_ptr(),
            weight.in_features,
            rows.data_ptr(),
            rows.numel(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        _raise_for(status, "dequant_rows", weight)
        return out


def _raise_for(status: int, kernel: str, weight: QuantWeight) -> None:
    """The kernels' status as an exception: -1 refused the weight, -2 ran out of memory."""
    if status == -2:
        raise MemoryError(f"the {kernel} kernel could not allocate its scratch")
    if status != 0:
        types = ", ".join(segment.qtype.name for segment in weight.segments)
        raise RuntimeError(
            f"the {kernel} kernel refused a weight of {types} with {weight.in_features} "
            f"inputs (status {status})"
        )
