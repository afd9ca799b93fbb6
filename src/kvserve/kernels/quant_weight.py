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


# The kernels' ids of Q4_K and Q6_K blocks with their quants reordered (KV_Q4_K_R and
# KV_Q6_K_R in csrc/quant.h).
Q4_K_REPACKED_ID = 112
Q6_K_REPACKED_ID = 113
REPACKED_IDS = {
    GGMLQuantizationType.Q4_K: Q4_K_REPACKED_ID,
    GGMLQuantizationType.Q6_K: Q6_K_REPACKED_ID,
}
# The block-32 types whose rows the kernels interleave eight at a time (the x8 layout,
# csrc/quant.h), and the offset of those layouts' ids from the GGUF type (KV_X8_OFFSET).
X8_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
)
X8_ID_OFFSET = 120
X8_GROUP = 8


@dataclass(frozen=True)
class QuantSegment:
    """``rows`` consecutive output rows of one type: ``data`` is uint8 ``[rows, row_bytes]``.

    repacked: in the layout the kernels' dot products read fastest, the same size and
    the same values: Q4_K and Q6_K blocks with their quants reordered, or Q4_0, Q4_1,
    Q5_0, Q5_1 and Q8_0 rows interleaved eight at a time (:func:`unrepack` puts any of
    them back).
    """

    qtype: GGMLQuantizationType
    rows: int
    data: torch.Tensor
    repacked: bool = False

    def __post_init__(self) -> None:
        if not self.repacked:
            return
        if self.qtype not in REPACKED_IDS and self.qtype not in X8_TYPES:
            raise ValueError(f"{self.qtype.name} blocks have no repacked layout")
        if self.qtype in X8_TYPES and self.rows % X8_GROUP:
            raise ValueError(
                f"{self.qtype.name} rows are interleaved {X8_GROUP} at a time; "
                f"{self.rows} rows are not"
            )

    @property
    def kernel_type(self) -> int:
        """The type id the kernels read these blocks as."""
        if not self.repacked:
            return int(self.qtype)
        if self.qtype in REPACKED_IDS:
            return REPACKED_IDS[self.qtype]
        return X8_ID_OFFSET + int(self.qtype)


def unrepack_x8(data: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Rows of a block-32 ``qtype`` interleaved eight at a time (``csrc/quant.h``'s x8
    layout) in GGUF's own layout again.

    A GGUF block is fields: the scale d (2 bytes), Q4_1's and Q5_1's minimum m (2), the
    Q5 types' fifth bits qh (4), then the quants, four bytes to a field. The x8 block of
    a group of eight rows holds each field of the eight rows together, in the block's
    order: the field at byte ``at`` of a GGUF block lies at ``8 * at``, row ``j``'s at
    ``8 * at + j * size``.
    """
    rows = data.shape[0]
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    groups = data.reshape(rows // X8_GROUP, -1, X8_GROUP * block_bytes)  # [group, block, ..]
    fields = []
    for at, size in x8_fields(qtype):
        field = groups[..., X8_GROUP * at : X8_GROUP * (at + size)]
        fields.append(field.reshape(*groups.shape[:2], X8_GROUP, size))
    blocks = torch.cat(fields, dim=-1)  # [group, block, row, block_bytes]
    return blocks.permute(0, 2, 1, 3).reshape(data.shape).contiguous()


def x8_fields(qtype: GGMLQuantizationType) -> list[tuple[int, int]]:
    """The fields of a GGUF block of ``qtype`` as (byte offset, bytes), in order."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    has_min = qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1)
    out, at = [], 0
    while at < block_bytes:
        size = 2 if at == 0 or (at == 2 and has_min) else 4
        out.append((at, size))
        at += size
    return out


def unrepack_q4_k(data: torch.Tensor) -> torch.Tensor:
    """Repacked Q4_K rows (uint8 ``[rows, row_bytes]``) in GGUF's own order again.

    In a repacked block, byte ``4j + t`` of 32-byte group ``L`` holds values
    ``8L + t`` (low nibble) and ``8L + 4 + t`` (high nibble) of sub-block ``j``;
    GGUF's group ``g`` holds value ``l`` of sub-blocks ``2g`` and ``2g + 1`` in
    the low and high nibbles of byte ``l``. The 16 bytes of scales come first in both.
    """
    blocks = data.reshape(data.shape[0], -1, 144)
    quants = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 8, 4).to(torch.int16)
    values = torch.empty(*blocks.shape[:2], 8, 32, dtype=torch.int16)  # [.., sub-block, value]
    for L in range(4):
        values[..., 8 * L : 8 * L + 4] = quants[..., L, :, :] & 0x0F
        values[..., 8 * L + 4 : 8 * L + 8] = quants[..., L, :, :] >> 4
    packed = values[..., 0::2, :] | (values[..., 1::2, :] << 4)  # [.., group, byte]
    out = blocks.clone()
    out[..., 16:] = packed.reshape(*blocks.shape[:2], 128).to(torch.uint8)
    return out.reshape(data.shape)


# Lane i of a repacked Q6_K half holds sub-block _Q6_LANE_SUB_BLOCK[i] of the half
# (LANE_SUB_BLOCK in csrc/quant_k.c).
_Q6_LANE_SUB_BLOCK = (0, 2, 4, 6, 1, 3, 5, 7)


def unrepack_q6_k(data: torch.Tensor) -> torch.Tensor:
    """Repacked Q6_K rows (uint8 ``[rows, row_bytes]``) in GGUF's own order again.

    A repacked block holds its quants (stored 32 above their values) as eight 32-byte
    vectors ``V[4h + L]``: byte ``4i + t`` is value ``4L + t`` of sub-block
    ``8h + (0, 2, 4, 6, 1, 3, 5, 7)[i]``. Bytes 0-127 hold their low four bits (``V[L]``
    in the low nibble of byte ``32L + b``, ``V[4 + L]`` in the high nibble), bytes
    128-191 their top two bits (``V[4h + L]`` at bits ``2L``, ``2L + 1`` of byte
    ``128 + 32h + b``), bytes 192-207 the sixteen scales in the same order as the
    sub-blocks, and d is last, as stored. GGUF's halves of 128 values take 64 bytes of
    low nibbles (values ``l`` and ``l + 64`` in byte ``l``) and 32 bytes of top bits
    (values ``l``, ``l + 32``, ``l + 64``, ``l + 96`` in byte ``l``).
    """
    blocks = data.reshape(data.shape[0], -1, 210)
    lead = blocks.shape[:2]
    low = blocks[..., :128].reshape(*lead, 4, 32).to(torch.int16)  # [.., L, byte]
    top = blocks[..., 128:192].reshape(*lead, 2, 1, 32).to(torch.int16)  # [.., h, 1, byte]
    shifts = torch.arange(0, 8, 2, dtype=torch.int16).reshape(4, 1)
    vectors = torch.stack([low & 0x0F, low >> 4], dim=-3)  # [.., h, L, byte]
    vectors = vectors | (((top >> shifts) & 3) << 4)
    # [.., h, L, i, t] -> [.., h, i, L, t]: lane i's 16 values in order, sub-blocks in lane order
    lanes = vectors.reshape(*lead, 2, 4, 8, 4).transpose(-3, -2).reshape(*lead, 2, 8, 16)
    order = torch.tensor(_Q6_LANE_SUB_BLOCK)
    values = torch.empty_like(lanes)
    values[..., order, :] = lanes
    values = values.reshape(*lead, 2, 4, 32)  # [.., h, 32-value chunk, l]
    ql = (values[..., 0:2, :] & 0x0F) | ((values[..., 2:4, :] & 0x0F) << 4)  # [.., h, 2, l]
    qh = (values >> 4) << shifts  # chunk k's top bits at bits 2k, 2k + 1
    qh = qh[..., 0, :] | qh[..., 1, :] | qh[..., 2, :] | qh[..., 3, :]
    scales = torch.empty_like(blocks[..., 192:208].reshape(*lead, 2, 8))
    scales[..., order] = blocks[..., 192:208].reshape(*lead, 2, 8)
    out = blocks.clone()
    out[..., :128] = ql.reshape(*lead, 128).to(torch.uint8)
    out[..., 128:192] = qh.reshape(*lead, 64).to(torch.uint8)
    out[..., 192:208] = scales.reshape(*lead, 16)
    return out.reshape(data.shape)


_UNREPACK = {GGMLQuantizationType.Q4_K: unrepack_q4_k, GGMLQuantizationType.Q6_K: unrepack_q6_k}


def unrepack(segment: QuantSegment) -> torch.Tensor:
    """A segment's blocks in GGUF's own order: its data, or the repacked blocks put back."""
    if not segment.repacked:
        return segment.data
    if segment.qtype in _UNREPACK:
        return _UNREPACK[segment.qtype](segment.data)
    return unrepack_x8(segment.data, segment.qtype)


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
            self.struct.seg[i] = _Segment(
                segment.kernel_type, segment.rows, segment.data.data_ptr()
            )

    @property
    def nbytes(self) -> int:
        return sum(segment.data.numel() for segment in self.segments)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight (gguf's reference dequantizer)."""
        from gguf.quants import dequantize

        parts = [
            torch.from_numpy(dequantize(unrepack(s).numpy(), s.qtype)).reshape(
                s.rows, self.in_features
            )
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
