"""Quantized weights multiplied in GGUF's blocks match PyTorch on the dequantized weight.

The reference is the gguf package: its quantizer writes the blocks and its dequantizer
gives the float32 weight, multiplied in float64. The kernels round the activations to
int8 in blocks of 32 (scale d = max|x| / 127, round to nearest), so an output may be off
by at most d / 2 per activation times the weight it meets: the sum over activation blocks
of d / 2 * sum |w|. That bound is computed from each test's inputs, plus a float32
arithmetic term far below it; with activations that are exact in int8 only the
arithmetic term is left, so a wrong offset or scale anywhere shows.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvserve.kernels import NativeOps
from kvserve.kernels.build import load_library
from kvserve.kernels.quant_weight import QuantSegment, QuantWeight
from proc_maps import linux_only, resident_file_bytes

TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
)
TYPE_IDS = [qtype.name for qtype in TYPES]
BLOCK = 32
EPS32 = torch.finfo(torch.float32).eps
# Output rows: not a multiple of the 4-row tile or of the rows a thread takes at a time.
OUT_FEATURES = 1003


@functools.cache
def segment(qtype: GGMLQuantizationType, rows: int, in_features: int, seed: int) -> QuantSegment:
    """Random rows quantized by gguf: rows of different scales and offsets (so the Q4_1 and
    Q5_1 minimums are far from zero), and one block of zeros (scale 0)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, in_features), dtype=np.float32)
    values *= rng.uniform(0.2, 3.0, size=(rows, 1)).astype(np.float32)
    values += rng.uniform(-1.0, 1.0, size=(rows, 1)).astype(np.float32)
    values[rows // 2, :BLOCK] = 0.0
    return QuantSegment(qtype, rows, torch.from_numpy(quantize(values, qtype)))


def activations(num_rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Random rows with a block of outliers (a scale of its own) and, past 64 inputs, a
    block of zeros."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator)
    x[:, :BLOCK] *= 50.0
    if in_features > 2 * BLOCK:
        x[0, BLOCK : 2 * BLOCK] = 0.0
    return x


def int8_exact_activations(num_rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Activations the int8 rounding keeps exactly: q * 2^e with |q| <= 127, each block's
    largest magnitude 127 so that its scale max|x| / 127 is 2^e itself."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_rows, in_features // BLOCK, BLOCK)
    q = torch.randint(-127, 128, shape, generator=generator)
    q[..., 0] = torch.where(torch.rand(shape[:2], generator=generator) < 0.5, -127, 127)
    scale = 2.0 ** torch.randint(-8, 3, (*shape[:2], 1), generator=generator)
    return (q * scale).float().reshape(num_rows, in_features)


def error_bound(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rounding: bool = True
) -> torch.Tensor:
    """The largest |kernel - float64 product| allowed, ``[M, N]``.

    rounding: the int8 rounding of x, d / 2 per activation times |w| (times 1 + 1e-4 for
    the float32 arithmetic that finds d and rounds x / d). Then float32 arithmetic: each
    block's term is a few roundings of quantities below four times the block's largest
    weight magnitude times its activations' magnitudes (the weights' quants and offsets,
    apart, are up to twice a weight), and K / 32 such terms are summed in float32.
    """
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    x64, w_abs = x.double(), weight.double().abs()
    num_blocks = in_features // BLOCK
    bound = torch.zeros(num_rows, out_features, dtype=torch.float64)
    if rounding:
        step = x64.abs().view(num_rows, num_blocks, BLOCK).amax(-1) / 127
        half_steps = (step / 2).repeat_interleave(BLOCK, dim=1)
        bound += (half_steps @ w_abs.T) * (1 + 1e-4)
    block_max = w_abs.view(out_features, num_blocks, BLOCK).amax(-1)
    bound += (num_blocks + 8) * 4 * EPS32 * (x64.abs() @ block_max.repeat_interleave(BLOCK, 1).T)
    if bias is not None:
        bound += 2 * EPS32 * bias.double().abs()
    return bound + 1e-30


def check_linear_quant(
    ops: NativeOps,
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None,
    rounding: bool = True,
) -> None:
    reference_weight = weight.dequantize()
    expected = x.double() @ reference_weight.double().T
    if bias is not None:
        expected += bias.double()
    # The int8 path at every row count, whose bounds these are (test_quant_many_rows.py
    # checks the many-row path, which larger row counts take by default).
    before = ops.quant_many_rows
    ops.set_quant_many_rows(1 << 40)
    try:
        out = ops.linear_quant(x, weight, bias)
    finally:
        ops.set_quant_many_rows(before)
    assert out.shape == (x.shape[0], weight.out_features) and out.dtype == torch.float32
    error = (out.double() - expected).abs()
    bound = error_bound(x, reference_weight, bias, rounding)
    worst = int((error / bound).argmax())
    assert bool((error <= bound).all()), (
        f"output {divmod(worst, out.shape[1])} is off by {error.flatten()[worst]:.3g}, "
        f"beyond the bound {bound.flatten()[worst]:.3g}"
    )


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("in_features", [64, 576, 2048])
def test_linear_quant_is_within_the_int8_rounding_of_its_activations(
    ops: NativeOps, qtype: GGMLQuantizationType, in_features: int
) -> None:
    weight = QuantWeight(in_features, [segment(qtype, OUT_FEATURES, in_features, 0)])
    for num_rows in (1, 3, 4, 17):
        x = activations(num_rows, in_features, seed=num_rows)
        bias = torch.randn(OUT_FEATURES) if num_rows % 2 else None
        check_linear_quant(ops, x, weight, bias)


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_linear_quant_is_exact_up_to_float32_on_activations_int8_holds(
    ops: NativeOps, qtype: GGMLQuantizationType
) -> None:
    weight = QuantWeight(576, [segment(qtype, OUT_FEATURES, 576, 1)])
    for num_rows in (1, 5):
        x = int8_exact_activations(num_rows, 576, seed=num_rows)
        check_linear_quant(ops, x, weight, torch.randn(OUT_FEATURES), rounding=False)


@pytest.mark.parametrize("num_rows", [1, 5, 70])
def test_linear_quant_writes_each_segment_at_its_columns(ops: NativeOps, num_rows: int) -> None:
    # 70 rows: more than one pass of the kernel's row block over the weights.
    segments = [
        segment(GGMLQuantizationType.Q4_0, 13, 576, 2),
        segment(GGMLQuantizationType.Q8_0, 130, 576, 3),
        segment(GGMLQuantizationType.Q5_1, 517, 576, 4),
        segment(GGMLQuantizationType.Q4_1, 7, 576, 5),
    ]
    weight = QuantWeight(576, segments)
    x = activations(num_rows, 576, seed=10 + num_rows)
    check_linear_quant(ops, x, weight, torch.randn(weight.out_features))
    check_linear_quant(ops, int8_exact_activations(num_rows, 576, 3), weight, None, rounding=False)


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_dequant_rows_equals_gguf_dequantize(ops: NativeOps, qtype: GGMLQuantizationType) -> None:
    weight = QuantWeight(576, [segment(qtype, 40, 576, 6)])
    rows = torch.tensor([5, 0, 39, 5, 20], dtype=torch.int64)
    out = ops.dequant_rows(weight, rows)
    assert torch.equal(out, weight.dequantize()[rows])
    assert ops.dequant_rows(weight, torch.zeros(0, dtype=torch.int64)).shape == (0, 576)


def test_dequant_rows_refuses_rows_outside_the_table(ops: NativeOps) -> None:
    weight = QuantWeight(64, [segment(GGMLQuantizationType.Q8_0, 10, 64, 7)])
    for rows in ([0, 10], [-1, 3]):
        with pytest.raises(ValueError, match="rows"):
            ops.dequant_rows(weight, torch.tensor(rows, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        ops.dequant_rows(weight, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="rows"):
        ops.dequant_rows(weight, torch.tensor([[1, 2]], dtype=torch.int64))
    two = QuantWeight(64, [segment(GGMLQuantizationType.Q8_0, 10, 64, 7)] * 2)
    with pytest.raises(ValueError, match="one segment"):
        ops.dequant_rows(two, torch.tensor([0], dtype=torch.int64))


def test_linear_quant_refuses_bad_shapes_and_dtypes(ops: NativeOps) -> None:
    weight = QuantWeight(64, [segment(GGMLQuantizationType.Q4_0, 10, 64, 8)])
    with pytest.raises(ValueError, match="x"):
        ops.linear_quant(torch.randn(3, 96), weight, None)
    with pytest.raises(ValueError, match="x"):
        ops.linear_quant(torch.randn(3, 64, dtype=torch.float64), weight, None)
    with pytest.raises(ValueError, match="x"):
        ops.linear_quant(torch.randn(64), weight, None)
    with pytest.raises(ValueError, match="bias"):
        ops.linear_quant(torch.randn(3, 64), weight, torch.randn(11))


def test_linear_quant_raises_when_the_kernel_refuses_the_weight(ops: NativeOps) -> None:
    weight = QuantWeight(64, [segment(GGMLQuantizationType.Q4_0, 10, 64, 8)])
    weight.struct.seg[0].type = 1  # F16: not a type the kernels multiply
    with pytest.raises(RuntimeError, match="refused"):
        ops.linear_quant(torch.randn(2, 64), weight, None)


def test_linear_quant_reads_its_input_contiguous(ops: NativeOps) -> None:
    weight = QuantWeight(64, [segment(GGMLQuantizationType.Q5_0, 10, 64, 9)])
    x = torch.randn(64, 3).T  # [3, 64], not contiguous
    check_linear_quant(ops, x, weight, None)


def test_the_portable_kernels_match_on_every_type() -> None:
    """The code CPUs without AVX2 run (a build for baseline x86-64)."""
    if platform.machine() != "x86_64":
        pytest.skip("builds for baseline x86-64")
    lib = load_library("x86-64")
    assert lib is not None
    portable = NativeOps(lib)
    for qtype in TYPES:
        weight = QuantWeight(576, [segment(qtype, 37, 576, 11)])
        for num_rows in (1, 6):
            check_linear_quant(portable, activations(num_rows, 576, seed=num_rows), weight, None)
            x = int8_exact_activations(num_rows, 576, seed=num_rows)
            check_linear_quant(portable, x, weight, torch.randn(37), rounding=False)
        rows = torch.tensor([36, 0, 3], dtype=torch.int64)
        assert torch.equal(portable.dequant_rows(weight, rows), weight.dequantize()[rows])


def test_activations_round_to_int8_blocks_as_the_contract_says(ops: NativeOps) -> None:
    """kv_quantize_q8: d = max|x| / 127, q = x / d rounded to nearest, s = d * sum(q)."""
    x = activations(3, 128, seed=20)
    x[1, 64:96] = 0.0
    blocks = np.zeros(3 * 4, dtype=[("d", "<f4"), ("s", "<f4"), ("q", "i1", 32)])
    quantize_q8 = ops.lib.kv_quantize_q8
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    quantize_q8.argtypes = [pointer, int64, int64, pointer, ctypes.c_int]
    quantize_q8.restype = None
    quantize_q8(x.data_ptr(), 3, 128, blocks.ctypes.data, 1)
    values = x.numpy().reshape(12, 32).astype(np.float64)
    d = np.abs(values).max(axis=1) / 127
    np.testing.assert_allclose(blocks["d"], d, rtol=1e-6)
    q = np.round(values / np.where(d > 0, d, 1)[:, None])
    assert np.abs(blocks["q"] - q).max() <= 1  # a tie may round either way in float32
    assert (np.abs(blocks["q"] * d[:, None] - values) <= d[:, None] * (0.5 + 1e-4)).all()
    np.testing.assert_allclose(blocks["s"], d * blocks["q"].sum(axis=1), rtol=1e-6)
    assert (blocks["q"][6] == 0).all() and blocks["d"][6] == 0.0  # the zero block


def test_linear_quant_of_no_rows_is_empty(ops: NativeOps) -> None:
    weight = QuantWeight(64, [segment(GGMLQuantizationType.Q8_0, 10, 64, 13)])
    assert ops.linear_quant(torch.zeros(0, 64), weight, None).shape == (0, 10)


def q4_k_segment(rows: int, in_features: int, seed: int) -> QuantSegment:
    """Random Q4_K blocks (gguf's Python quantizer has no Q4_K): any quants and 6-bit
    scales, with fp16 d and dmin of a weight's size."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, in_features // 256, 144), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(rows, in_features // 256, 2)).astype(np.float16)
    blocks[..., :4] = scales.view(np.uint8)
    return QuantSegment(GGMLQuantizationType.Q4_K, rows, torch.from_numpy(blocks.reshape(rows, -1)))


@pytest.mark.parametrize("num_rows", [1, 3, 40])
def test_kernel_layout_repacks_q4_k_and_multiplies_the_same(ops: NativeOps, num_rows: int) -> None:
    """Q4_K segments are repacked (on x86 with AVX2) and every product, one row of
    activations, a few, or enough for the dequantizing many-row path, is the same float
    as with the blocks as stored; other types are kept as they are."""
    in_features = 512
    stored = QuantWeight(
        in_features,
        [q4_k_segment(10, in_features, 3), segment(GGMLQuantizationType.Q8_0, 6, in_features, 4)],
    )
    laid = ops.kernel_layout(stored)
    assert laid.segments[0].repacked
    assert not torch.equal(laid.segments[0].data, stored.segments[0].data)
    assert laid.segments[1] is stored.segments[1]
    x = activations(num_rows, in_features, seed=num_rows)
    assert torch.equal(ops.linear_quant(x, laid, None), ops.linear_quant(x, stored, None))
    assert torch.equal(laid.dequantize(), stored.dequantize())
    assert ops.kernel_layout(laid) is laid  # already laid out


def q6_k_segment(rows: int, in_features: int, seed: int) -> QuantSegment:
    """Random Q6_K blocks: any quants and signed 8-bit scales, fp16 d of a weight's size."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, in_features // 256, 210), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-3, size=(rows, in_features // 256, 1)).astype(np.float16)
    blocks[..., 208:] = d.view(np.uint8)
    return QuantSegment(GGMLQuantizationType.Q6_K, rows, torch.from_numpy(blocks.reshape(rows, -1)))


# 100: past the 64 rows one pass over the weights serves, on the int8 path where the
# many-row threshold is higher (AVX2 without AVX512-BF16).
@pytest.mark.parametrize("num_rows", [1, 3, 40, 100])
def test_kernel_layout_repacks_a_fused_q4_k_and_q6_k_weight(ops: NativeOps, num_rows: int) -> None:
    """A fused projection whose pieces are Q4_K, Q8_0 and Q6_K (a Q4_K_M file's qkv with
    attn_v in Q6_K): both K-quants repacked, the activations transposed both ways in one
    call, and every product the same float as with the blocks as stored; Q6_K alone
    (output.weight) too."""
    if not ops.lib.kv_q4_k_repack_pays():
        pytest.skip("this build multiplies the stored layouts")
    in_features = 768
    stored = QuantWeight(
        in_features,
        [
            q4_k_segment(10, in_features, 6),
            segment(GGMLQuantizationType.Q8_0, 5, in_features, 7),
            q6_k_segment(9, in_features, 8),
        ],
    )
    laid = ops.kernel_layout(stored)
    assert [s.repacked for s in laid.segments] == [True, False, True]
    assert not torch.equal(laid.segments[2].data, stored.segments[2].data)
    x = activations(num_rows, in_features, seed=num_rows)
    assert torch.equal(ops.linear_quant(x, laid, None), ops.linear_quant(x, stored, None))
    bias = torch.randn(24)
    assert torch.equal(ops.linear_quant(x, laid, bias), ops.linear_quant(x, stored, bias))
    assert torch.equal(laid.dequantize(), stored.dequantize())
    threshold = ops.quant_many_rows
    try:
        ops.set_quant_many_rows(1)  # the dequantizing path, at any row count
        assert torch.equal(ops.linear_quant(x, laid, bias), ops.linear_quant(x, stored, bias))
    finally:
        ops.set_quant_many_rows(threshold)
    alone = QuantWeight(in_features, [stored.segments[2]])
    assert torch.equal(
        ops.linear_quant(x, ops.kernel_layout(alone), None), ops.linear_quant(x, alone, None)
    )
    # The stored layout's products are right (against the dequantized weight, float64).
    check_linear_quant(ops, x, alone, None)


@pytest.mark.parametrize("make", [q4_k_segment, q6_k_segment], ids=["Q4_K", "Q6_K"])
def test_kernel_layout_serves_embedding_rows(
    ops: NativeOps, make: Callable[..., QuantSegment]
) -> None:
    table = QuantWeight(256, [make(12, 256, 5)])
    rows = torch.tensor([11, 0, 5, 5], dtype=torch.int64)
    laid = ops.kernel_layout(table)
    assert torch.equal(ops.dequant_rows(laid, rows), ops.dequant_rows(table, rows))
    assert torch.equal(ops.dequant_rows(laid, rows), table.dequantize()[rows])


@linux_only
def test_dropping_a_copied_files_pages_keeps_its_bytes(tmp_path: Path) -> None:
    from kvserve.kernels.file_pages import drop_file_pages

    data = np.random.default_rng(0).integers(0, 256, size=5 * 4096 + 100, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    assert int(mapped.sum()) == int(data.sum())  # every page read once
    assert resident_file_bytes(path) >= 5 * 4096
    drop_file_pages(mapped[50:])
    assert resident_file_bytes(path) <= 2 * 4096  # the partial first and last pages stay
    assert torch.equal(mapped, torch.from_numpy(data))  # read back from the file
    anonymous = torch.from_numpy(data.copy())
    drop_file_pages(anonymous)  # anonymous memory: left alone
    assert torch.equal(anonymous, torch.from_numpy(data))
