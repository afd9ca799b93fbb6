"""A quantized linear weight as the kernels read it: GGUF's own blocks, in segments of rows.

GGUF stores each row of a quantized matrix as consecutive blocks of its type
(``Q8_0``: 32 values in 34 bytes; ``Q4_K``: 256 values in 144 bytes). The
kernels (``kernels/csrc/quant.h``) multiply those blocks as they are. A fused
projection (qkv, gate_up) assembled from several GGUF tensors may hold pieces
of different types (a Q4_K_M file keeps ``attn_v`` in Q6_K or Q8_0 beside a
Q4_K or Q5_0 ``attn_q``), so a weight is a list of segments, each a run of
rows of one type; the output's columns are the segments' rows in order.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# The types the kernels multiply (kernels/csrc/quant.h's KV_GGML_*).
QUANT_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
MAX_SEGMENTS = 4  # KV_QUANT_MAX_SEGMENTS


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values of ``qtype``; ValueError where they do not fit."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantized type {qtype.name} is not one the kernels multiply")
    block, size = GGML_QUANT_SIZES[qtype]
    if in_features % block:
        raise ValueError(
            f"{qtype.name} rows hold whole blocks of {block} values; {in_features} is not"
        )
    return in_features // block * size


@dataclass(frozen=True)
class QuantSegment:
    """``rows`` consecutive output rows of one type: ``data`` is uint8 ``[rows, row_bytes]``."""

    qtype: GGMLQuantizationType
    rows: int
    data: torch.Tensor


class _Segment(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int64), ("rows", ctypes.c_int64), ("data", ctypes.c_void_p)]


class KvQuantWeight(ctypes.Structure):
    """``KvQuantWeight`` in ``kernels/csrc/quant.h``."""

    _fields_ = [("num_segments", ctypes.c_int64), ("seg", _Segment * MAX_SEGMENTS)]


class QuantWeight:
    """A quantized ``[out_features, in_features]`` weight; its tensors must stay alive with it.

    segments: at most :data:`MAX_SEGMENTS`, each uint8 ``[rows, row_bytes(qtype,
    in_features)]`` and contiguous on the CPU. ``struct`` is the C view the
    kernels take (its address: ``ctypes.addressof(weight.struct)``).
    """

    def __init__(self, in_features: int, segments: list[QuantSegment]) -> None:
        if not 1 <= len(segments) <= MAX_SEGMENTS:
            raise ValueError(f"a quantized weight has 1 to {MAX_SEGMENTS} segments")
        for segment in segments:
            expected = (segment.rows, row_bytes(segment.qtype, in_features))
            if segment.data.dtype != torch.uint8 or tuple(segment.data.shape) != expected:
                raise ValueError(
                    f"a {segment.qtype.name} segment of {segment.rows} rows of {in_features} "
                    f"values is uint8 {expected}, not {segment.data.dtype} "
                    f"{tuple(segment.data.shape)}"
                )
            if not segment.data.is_contiguous() or segment.data.device.type != "cpu":
                raise ValueError("quantized weight data must be contiguous CPU memory")
        self.in_features = in_features
        self.out_features = sum(segment.rows for segment in segments)
        self.segments = tuple(segments)
        self.struct = KvQuantWeight(len(segments))
        for i, segment in enumerate(segments):
            self.struct.seg[i] = _Segment(int(segment.qtype), segment.rows, segment.data.data_ptr())

    @property
    def nbytes(self) -> int:
        return sum(segment.data.numel() for segment in self.segments)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight (gguf's reference dequantizer)."""
        from gguf.quants import dequantize

        parts = [
            torch.from_numpy(dequantize(s.data.numpy(), s.qtype).reshape(s.rows, self.in_features))
            for s in self.segments
        ]
        return torch.cat(parts).float()


@dataclass(frozen=True)
class QuantizedTensor:
    """A checkpoint tensor kept in its quantized blocks, as the loader hands it to a layer.

    ``rows`` rows of ``in_features`` values (PyTorch's ``[out_features,
    in_features]``); data: uint8 ``[rows, row_bytes(qtype, in_features)]``, a
    view of the file or memory of its own. Rows are whole units: a layer may
    reorder or slice them (RoPE row order, tensor-parallel shards) without
    touching a block.
    """

    qtype: GGMLQuantizationType
    rows: int
    in_features: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        expected = (self.rows, row_bytes(self.qtype, self.in_features))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"a {self.qtype.name} tensor of {self.rows} rows of {self.in_features} values "
                f"is uint8 {expected}, not {self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.in_features)

    def take_rows(self, index: torch.Tensor | slice) -> QuantizedTensor:
        """The rows ``index`` selects (a slice or an int64 index), in that order."""
        data = self.data[index].contiguous()
        return QuantizedTensor(self.qtype, int(data.shape[0]), self.in_features, data)

    def segment(self) -> QuantSegment:
        """These rows as one segment of a :class:`QuantWeight` (data made contiguous)."""
        return QuantSegment(self.qtype, self.rows, self.data.contiguous())

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[rows, in_features]`` values (gguf's reference dequantizer)."""
        return QuantWeight(self.in_features, [self.segment()]).dequantize()
