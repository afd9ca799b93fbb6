"""The x8 layout: Q4_0, Q4_1 and Q8_0 rows interleaved eight at a time (csrc/quant.h).

``QuantOps.kernel_layout`` rewrites those segments (on x86 with AVX2) so that one
vector lane holds one weight row's sum. Nothing about the numbers may change: the
Python reading of the layout (``unrepack_x8``, written from the layout's description,
not from the C code) must give back GGUF's bytes exactly, and every product, row
lookup and dequantized weight must be the same float as with the rows as stored, at
every row count the int8 tile takes in one pass or several, and on the many-row path.
The products are also checked against the float64 reference within the int8 bound.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_quant_kernels import activations, check_linear_quant, segment

from kvserve.errors import InvalidParameterError
from kvserve.kernels import NativeOps
from kvserve.kernels.build import load_library
from kvserve.kernels.quant_weight import (
    X8_ID_OFFSET,
    X8_TYPES,
    QuantSegment,
    QuantWeight,
    unrepack,
    unrepack_x8,
)
from native_targets import cpu_flags

X8_IDS = [qtype.name for qtype in X8_TYPES]
# Row counts of x: one, a tile of four (AVX2) or eight (AVX-512) and less, more than one
# pass, and past the bound of a pass.
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17)


def int8_path(ops: NativeOps, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    before = ops.quant_many_rows
    ops.set_quant_many_rows(1 << 40)
    try:
        return ops.linear_quant(x, weight, None)
    finally:
        ops.set_quant_many_rows(before)


@pytest.mark.parametrize("qtype", X8_TYPES, ids=X8_IDS)
@pytest.mark.parametrize("in_features", [64, 576])
def test_x8_rows_multiply_to_the_same_floats(
    ops: NativeOps, qtype: GGMLQuantizationType, in_features: int
) -> None:
    stored = QuantWeight(in_features, [segment(qtype, 40, in_features, 21)])
    laid = ops.kernel_layout(stored)
    (x8,) = laid.segments
    assert x8.repacked and x8.kernel_type == X8_ID_OFFSET + int(qtype)
    assert not torch.equal(x8.data, stored.segments[0].data)
    # The layout as documented: the Python reading gives GGUF's bytes back.
    assert torch.equal(unrepack_x8(x8.data, qtype), stored.segments[0].data)
    for num_rows in ROW_COUNTS:
        x = activations(num_rows, in_features, seed=num_rows)
        assert torch.equal(int8_path(ops, x, laid), int8_path(ops, x, stored)), num_rows
    check_linear_quant(ops, activations(6, in_features, seed=6), laid, torch.randn(40))
    assert torch.equal(laid.dequantize(), stored.dequantize())
    rows = torch.tensor([39, 0, 8, 7, 7, 21], dtype=torch.int64)
    assert torch.equal(ops.dequant_rows(laid, rows), ops.dequant_rows(stored, rows))
    assert ops.kernel_layout(laid) is laid  # already laid out


@pytest.mark.parametrize("qtype", X8_TYPES, ids=X8_IDS)
def test_the_wide_tiles_multiply_to_the_same_floats(
    ops: NativeOps, qtype: GGMLQuantizationType
) -> None:
    """The 512-bit tiles (two groups of eight rows at a time, where built) against the
    256-bit ones at every row count, on a weight whose threads' shares end mid-pair."""
    if not ops.x8_wide_built:
        pytest.skip("this build has no 512-bit x8 tiles")
    stored = QuantWeight(576, [segment(qtype, 56, 576, 23)])
    laid = ops.kernel_layout(stored)
    before = ops.quant_x8_wide_rows
    try:
        for num_rows in ROW_COUNTS:
            x = activations(num_rows, 576, seed=100 + num_rows)
            results = []
            for wide_from in (1, 1 << 40, num_rows):
                ops.set_quant_x8_wide_rows(wide_from)
                assert ops.quant_x8_wide_rows == wide_from
                results.append(int8_path(ops, x, laid))
            assert torch.equal(results[0], results[1]), num_rows
            assert torch.equal(results[2], results[1]), num_rows
            assert torch.equal(results[0], int8_path(ops, x, stored)), num_rows
        with pytest.raises(InvalidParameterError, match="rows"):
            ops.set_quant_x8_wide_rows(0)
    finally:
        ops.set_quant_x8_wide_rows(before)


def test_the_many_row_path_reads_x8_rows(ops: NativeOps) -> None:
    stored = QuantWeight(576, [segment(GGMLQuantizationType.Q4_1, 48, 576, 22)])
    laid = ops.kernel_layout(stored)
    x = activations(20, 576, seed=20)
    before = ops.quant_many_rows
    ops.set_quant_many_rows(4)
    try:
        assert torch.equal(ops.linear_quant(x, laid, None), ops.linear_quant(x, stored, None))
    finally:
        ops.set_quant_many_rows(before)


def test_mixed_segments_keep_their_columns(ops: NativeOps) -> None:
    """x8 segments beside stored ones (a fused projection): rows not a multiple of eight
    and types without the layout stay as they are; every column lands where it did."""
    stored = QuantWeight(
        256,
        [
            segment(GGMLQuantizationType.Q8_0, 24, 256, 31),
            segment(GGMLQuantizationType.Q4_0, 12, 256, 32),  # 12 rows: not interleaved
            segment(GGMLQuantizationType.Q5_1, 4, 256, 33),  # 4 rows: not interleaved
            segment(GGMLQuantizationType.Q4_1, 8, 256, 34),
        ],
    )
    laid = ops.kernel_layout(stored)
    assert [s.repacked for s in laid.segments] == [True, False, False, True]  # 24, 12, 4, 8
    assert laid.segments[1] is stored.segments[1] and laid.segments[2] is stored.segments[2]
    for num_rows in (1, 5, 9):
        x = activations(num_rows, 256, seed=40 + num_rows)
        bias = torch.randn(48)
        before = ops.quant_many_rows
        ops.set_quant_many_rows(1 << 40)
        try:
            assert torch.equal(ops.linear_quant(x, laid, bias), ops.linear_quant(x, stored, bias))
        finally:
            ops.set_quant_many_rows(before)


# Each type's GGUF block as (field, bytes) in order (ggml's block_q4_0 ... block_q8_0).
GGUF_FIELDS = {
    GGMLQuantizationType.Q4_0: [("d", 2), ("qs", 16)],
    GGMLQuantizationType.Q4_1: [("d", 2), ("m", 2), ("qs", 16)],
    GGMLQuantizationType.Q5_0: [("d", 2), ("qh", 4), ("qs", 16)],
    GGMLQuantizationType.Q5_1: [("d", 2), ("m", 2), ("qh", 4), ("qs", 16)],
    GGMLQuantizationType.Q8_0: [("d", 2), ("qs", 32)],
}


@pytest.mark.parametrize("qtype", X8_TYPES, ids=X8_IDS)
def test_the_largest_quants_against_the_largest_activations_do_not_overflow(
    ops: NativeOps, qtype: GGMLQuantizationType
) -> None:
    """Every quant at its type's extreme (15, 31, or -128 and 127 for Q8_0) against
    activations of magnitude 127 of one sign: the int8 tiles' integer sums at their
    largest (the AVX2 tiles add 16-bit partial sums). Activations the rounding keeps
    exactly, so any overflow would be far outside the float bound."""
    in_features, rows = 256, 16
    half_one = np.float16(1.0).tobytes()
    fields = {
        "d": half_one,
        "m": np.float16(0.0).tobytes(),
        "qh": b"\xff" * 4,
        "qs": b"\xff" * 16,
    }
    blocks = []
    for row in range(rows):
        if qtype == GGMLQuantizationType.Q8_0:
            block = half_one + (b"\x80" if row % 2 else b"\x7f") * 32
        else:
            block = b"".join(fields[name] for name, _ in GGUF_FIELDS[qtype])
        blocks.append(block * (in_features // 32))
    data = torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8).view(rows, -1)
    stored = QuantWeight(in_features, [QuantSegment(qtype, rows, data.clone())])
    laid = ops.kernel_layout(stored)
    x = torch.full((6, in_features), 127.0)
    x[1::2] = -127.0
    x[4] *= 2.0**-6
    check_linear_quant(ops, x, laid, None, rounding=False)
    check_linear_quant(ops, x, stored, None, rounding=False)


@pytest.mark.parametrize("qtype", X8_TYPES, ids=X8_IDS)
def test_unrepack_puts_each_rows_bytes_back(qtype: GGMLQuantizationType) -> None:
    """The layout built here from its description, on bytes that name their place (row r's
    block b byte i holds a value computed from r, b and i, so any misplaced byte shows):
    each field of the eight rows together, the quants four bytes of each row at a time."""
    rows, blocks = 16, 3
    block_bytes = sum(size for _, size in GGUF_FIELDS[qtype])
    r, b, i = torch.meshgrid(
        torch.arange(rows), torch.arange(blocks), torch.arange(block_bytes), indexing="ij"
    )
    gguf = ((r * 7 + b * 31 + i * 3) % 251).to(torch.uint8).reshape(rows, blocks, block_bytes)
    groups = []
    for g in range(rows // 8):
        for blk in range(blocks):
            eight = gguf[8 * g : 8 * g + 8, blk]  # [row, byte]
            parts, at = [], 0
            for name, size in GGUF_FIELDS[qtype]:
                field = eight[:, at : at + size]
                if name == "qs":  # four bytes of each row in turn
                    parts += [field[:, 4 * c : 4 * c + 4].reshape(-1) for c in range(size // 4)]
                else:
                    parts.append(field.reshape(-1))
                at += size
            groups.append(torch.cat(parts))
    laid = torch.cat(groups).reshape(rows, -1)
    flat = gguf.reshape(rows, -1)
    assert torch.equal(unrepack_x8(laid, qtype), flat)
    assert torch.equal(unrepack(QuantSegment(qtype, rows, laid, repacked=True)), flat)


def test_only_whole_groups_of_the_x8_types_are_repacked() -> None:
    data = torch.zeros(12, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="interleaved 8 at a time"):
        QuantSegment(GGMLQuantizationType.Q4_0, 12, data, repacked=True)
    with pytest.raises(ValueError, match="no repacked layout"):
        QuantSegment(GGMLQuantizationType.Q5_K, 8, torch.zeros(8, 176, dtype=torch.uint8), True)


def test_the_portable_build_keeps_gguf_rows_and_refuses_x8_products() -> None:
    """CPUs without AVX2 multiply GGUF's layout: kernel_layout leaves the block-32 types as
    they are, and an x8 segment handed to the product is refused, not misread; its rows
    still dequantize (the layout is read in plain C)."""
    if platform.machine() != "x86_64" or "avx2" not in cpu_flags():
        pytest.skip("builds for baseline x86-64, and lays rows out with the AVX2 build")
    lib = load_library("x86-64")
    assert lib is not None
    portable = NativeOps(lib)
    stored = QuantWeight(64, [segment(GGMLQuantizationType.Q4_1, 16, 64, 51)])
    assert portable.kernel_layout(stored) is stored
    avx2 = load_library("x86-64-v3")
    assert avx2 is not None
    native_laid = NativeOps(avx2).kernel_layout(stored)
    with pytest.raises(RuntimeError, match="refused"):
        portable.linear_quant(torch.randn(1, 64), native_laid, None)
    rows = torch.tensor([15, 3], dtype=torch.int64)
    assert torch.equal(portable.dequant_rows(native_laid, rows), stored.dequantize()[rows])


class _Store:
    """A repacked-segment store holding one segment's blocks (``RepackedSegments``)."""

    def __init__(self, data: torch.Tensor | None) -> None:
        self.data = data
        self.kept: list[int] = []
        self.rejected: list[str] = []

    def find(self, index: int, segment: QuantSegment, kernel_type: int) -> torch.Tensor | None:
        return self.data

    def keep(self, index: int, segment: QuantSegment, kernel_type: int, data: torch.Tensor) -> None:
        self.kept.append(kernel_type)

    def reject(self, index: int, reason: str) -> None:
        self.rejected.append(reason)


def test_stored_x8_rows_are_used_when_their_groups_check_out(ops: NativeOps) -> None:
    """A store's x8 blocks are taken as they are when a few whole groups of eight rows,
    repacked again from the model file, equal them; a store holding another group in one
    of the checked places is refused and the segment repacked from the file."""
    qtype = GGMLQuantizationType.Q4_1
    stored = QuantWeight(64, [segment(qtype, 48, 64, 61)])
    laid = ops.kernel_layout(stored).segments[0].data
    store = _Store(laid.clone())
    taken = ops.kernel_layout(stored, store).segments[0]
    assert taken.data is store.data and not store.rejected and not store.kept
    swapped = laid.clone()
    swapped[:8], swapped[8:16] = laid[8:16], laid[:8]  # group 0 is always checked
    store = _Store(swapped)
    redone = ops.kernel_layout(stored, store).segments[0]
    assert len(store.rejected) == 1 and store.kept == [X8_ID_OFFSET + int(qtype)]
    assert torch.equal(redone.data, laid)
    store = _Store(None)  # nothing stored: repacked and kept
    assert torch.equal(ops.kernel_layout(stored, store).segments[0].data, laid)
    assert store.kept == [X8_ID_OFFSET + int(qtype)]
