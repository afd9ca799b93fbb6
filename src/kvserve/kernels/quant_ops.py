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
import functools
import os
from collections.abc import Callable
from typing import Protocol

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.errors import InvalidParameterError
from kvserve.kernels.bounds import check_float_tensor
from kvserve.kernels.file_pages import drop_file_pages
from kvserve.kernels.quant_weight import (
    Q4_K_REPACKED_ID,
    Q6_K_REPACKED_ID,
    X8_GROUP,
    X8_ID_OFFSET,
    X8_TYPES,
    QuantSegment,
    QuantWeight,
)

_p = ctypes.c_void_p
_i64 = ctypes.c_int64

# The activations are quantized in blocks of this many values, for every type.
ACTIVATION_BLOCK = 32
# Rows of activations from which linear_quant takes the many-row path (a positive
# integer); unset, the kernel's own default.
MANY_ROWS_ENV = "KVSERVE_QUANT_MANY_ROWS"


class RepackedSegments(Protocol):
    """Repacked segments of one weight kept from an earlier load, by segment index.

    :meth:`QuantOps.kernel_layout` asks :meth:`find` before it repacks a segment,
    :meth:`keep` after, and :meth:`reject` when what ``find`` gave is not that segment.
    """

    def find(self, index: int, segment: QuantSegment, kernel_type: int) -> torch.Tensor | None:
        """The blocks of ``segment`` repacked as ``kernel_type``, as stored; None when absent."""
        ...

    def keep(self, index: int, segment: QuantSegment, kernel_type: int, data: torch.Tensor) -> None:
        """``data``, ``segment`` repacked as ``kernel_type``, for the next load."""
        ...

    def reject(self, index: int, reason: str) -> None:
        """What :meth:`find` gave for segment ``index`` is wrong (``reason``)."""
        ...


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
        self._repack_q6_k = lib.kv_q6_k_repack_rows
        self._repack_q6_k.argtypes = [_p, _i64, _i64, _p, ctypes.c_int]
        self._repack_q6_k.restype = ctypes.c_int
        self._repack_x8 = lib.kv_q32_x8_repack_rows
        self._repack_x8.argtypes = [_i64, _p, _i64, _i64, _p, ctypes.c_int]
        self._repack_x8.restype = ctypes.c_int
        # Each type this build repacks: the kernel type id of its repacked blocks, and
        # the function that repacks rows of them (src, rows, in_features, dst, threads).
        self._repackers: dict[GGMLQuantizationType, tuple[int, Callable[..., int]]] = {}
        if lib.kv_q4_k_repack_pays():
            self._repackers[GGMLQuantizationType.Q4_K] = (Q4_K_REPACKED_ID, self._repack_q4_k)
            self._repackers[GGMLQuantizationType.Q6_K] = (Q6_K_REPACKED_ID, self._repack_q6_k)
        if lib.kv_q32_x8_pays():
            for qtype in X8_TYPES:
                self._repackers[qtype] = (
                    X8_ID_OFFSET + int(qtype),
                    functools.partial(self._repack_x8, int(qtype)),
                )
        self._set_many_rows = lib.kv_quant_set_many_rows
        self._set_many_rows.argtypes = [_i64]
        self._set_many_rows.restype = None
        self._stream_nta = lib.kv_quant_stream_nta
        self._stream_nta.argtypes = []
        self._stream_nta.restype = ctypes.c_int
        self._set_stream_nta = lib.kv_quant_set_stream_nta
        self._set_stream_nta.argtypes = [ctypes.c_int]
        self._set_stream_nta.restype = None
        self.x8_wide_built = bool(lib.kv_quant_x8_wide_built())
        self._x8_wide_rows = lib.kv_quant_x8_wide_rows
        self._x8_wide_rows.argtypes = []
        self._x8_wide_rows.restype = _i64
        self._set_x8_wide_rows = lib.kv_quant_set_x8_wide_rows
        self._set_x8_wide_rows.argtypes = [_i64]
        self._set_x8_wide_rows.restype = None
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

    @property
    def quant_stream_nta(self) -> bool:
        """Whether the block-32 kernels prefetch the weight stream non-temporally
        (``PREFETCHNTA``) rather than into L2; the products are the same either way."""
        return bool(self._stream_nta())

    def set_quant_stream_nta(self, nta: bool) -> None:
        """Prefetch the block-32 weight streams non-temporally or not (for every user of
        this library)."""
        if not isinstance(nta, bool):
            raise InvalidParameterError("nta", f"True or False, not {nta!r}")
        self._set_stream_nta(int(nta))

    @property
    def quant_x8_wide_rows(self) -> int:
        """Rows of ``x`` from which the block-32 x8 kernels multiply sixteen weight rows at
        a time in 512-bit registers (``x8_wide_built``: where the build has them; the
        products are the same floats either way)."""
        return int(self._x8_wide_rows())

    def set_quant_x8_wide_rows(self, rows: int) -> None:
        """Use the 512-bit x8 tiles from ``rows`` rows of ``x`` up (for every user of this
        library; a count past any batch turns them off)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise InvalidParameterError("rows", f"a whole number, 1 or more, not {rows!r}")
        self._set_x8_wide_rows(rows)

    @property
    def repack_layouts(self) -> dict[GGMLQuantizationType, int]:
        """The types this build repacks, each with the kernel type id of its repacked blocks
        (empty where it repacks none: the portable build, CPUs without AVX2)."""
        return {qtype: kernel_type for qtype, (kernel_type, _) in self._repackers.items()}

    def repack_rows(self, qtype: GGMLQuantizationType, data: torch.Tensor) -> torch.Tensor:
        """A repacked copy of ``data``, rows of ``qtype`` blocks (uint8 ``[rows, row_bytes]``,
        a type in :attr:`repack_layouts`). The K-quants' rows are repacked each on its
        own, the block-32 types' in groups of :data:`X8_GROUP` (``data`` a whole number of
        groups), so the rows of any slice or gather of whole units repack to the same
        rows of the whole."""
        if qtype not in self._repackers:
            raise ValueError(f"this build does not repack {qtype.name} blocks")
        if qtype in X8_TYPES and data.shape[0] % X8_GROUP:
            raise ValueError(
                f"{qtype.name} rows are repacked {X8_GROUP} at a time, not {data.shape[0]}"
            )
        _, repack = self._repackers[qtype]
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        in_features = data.shape[1] // block_bytes * block_values
        data = data.contiguous()
        out = torch.empty_like(data)
        status = repack(
            data.data_ptr(), data.shape[0], in_features, out.data_ptr(), torch.get_num_threads()
        )
        if status == -2:
            raise MemoryError(f"the {qtype.name} repack kernel could not allocate its scratch")
        if status != 0:
            raise RuntimeError(
                f"the {qtype.name} repack kernel refused {tuple(data.shape)} (status {status})"
            )
        return out

    def kernel_layout(
        self, weight: QuantWeight, store: RepackedSegments | None = None
    ) -> QuantWeight:
        """``weight`` as these kernels multiply it fastest: its segments of a type in
        :attr:`repack_layouts` repacked, where this build has those paths (x86 with
        AVX2); otherwise ``weight`` itself. Q4_K and Q6_K: the quants of each block
        reordered, so a dot product sums each sub-block in one vector lane and needs no
        horizontal additions; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 segments of a multiple of
        eight rows: interleaved eight rows at a time (each vector lane one row's sum,
        each activation row read once per eight weight rows). The values are the same,
        and so are the products, bit for bit.

        store: where repacked segments are looked up before repacking and kept after
        (the model's cache entry, ``loader/repacked_cache.py``). What it hands back is
        checked first: a few rows of the stored blocks are repacked here and must equal
        its rows, or the segment is repacked after all (and the store told so).
        """
        layouts = self.repack_layouts
        if not layouts:
            return weight
        segments, changed = [], False
        for index, segment in enumerate(weight.segments):
            kernel_type = layouts.get(segment.qtype)
            whole_groups = segment.qtype not in X8_TYPES or segment.rows % X8_GROUP == 0
            if kernel_type is None or segment.repacked or not whole_groups:
                segments.append(segment)
                continue
            changed = True
            data = None if store is None else store.find(index, segment, kernel_type)
            if data is not None and store is not None:
                problem = self._spot_check(segment, data)
                if problem is not None:
                    store.reject(index, problem)
                    data = None
            if data is None:
                data = self.repack_rows(segment.qtype, segment.data)
                if store is not None:
                    store.keep(index, segment, kernel_type, data)
            segments.append(QuantSegment(segment.qtype, segment.rows, data, repacked=True))
            drop_file_pages(segment.data)
        return QuantWeight(weight.in_features, segments) if changed else weight

    def _spot_check(self, segment: QuantSegment, stored: torch.Tensor) -> str | None:
        """Why ``stored`` is not ``segment`` repacked, from a few of its rows; None when
        they match. Rows spread through the segment (not only the first and last, which
        a reordering of rows may leave in place) catch another tensor, another row order
        or another repacked layout, for the cost of reading a few pages of each."""
        if stored.dtype != torch.uint8 or stored.shape != segment.data.shape:
            return f"it holds {stored.dtype} {tuple(stored.shape)}"
        # Units repacked on their own: a row, or a group of eight rows for the x8 layout.
        unit = X8_GROUP if segment.qtype in X8_TYPES else 1
        units = segment.rows // unit
        firsts = torch.tensor(sorted({0, units // 3 + 1, (2 * units) // 3 + 2, units - 1}))
        firsts = firsts[firsts < units]
        picked = (firsts[:, None] * unit + torch.arange(unit)).reshape(-1)
        if not torch.equal(self.repack_rows(segment.qtype, segment.data[picked]), stored[picked]):
            return "its rows differ from the model file's, repacked"
        return None

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
