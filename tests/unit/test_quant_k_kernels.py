"""The K-quant kernels (csrc/quant_k.c) against gguf's reference dequantizer and PyTorch.

The functions are called straight through ctypes, on every instruction set the
library is built for here: this CPU's (VNNI where it has it), AVX2 without
AVX-512 (VPMADDUBSW), and baseline x86-64 (the plain C path other CPUs run).
Activations are quantized to KvQ8Block rows in numpy, independently of the
kernels; products are compared with float64 matmuls of gguf's dequantized
weights.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.kernels.build import build_library
from kvserve.kernels.quant_k_ops import quantize_q4_k
from kvserve.kernels.quant_weight import REPACKED_IDS, unrepack_q4_k, unrepack_q6_k
from kvserve.loader.gguf_reader import read_gguf
from native_targets import cpu_flags

Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K
GEMMA_GGUF = Path("/root/.cache/kvserve/gguf/gemma-3-270m-q4_k_m.gguf")
# KvQ8Block in csrc/quant.h: q[i] * d approximates x[i], s = d * sum(q).
Q8_BLOCK = np.dtype([("d", "<f4"), ("s", "<f4"), ("q", "i1", (32,))])
EPS = float(np.finfo(np.float32).eps)

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    if request.param != "native" and (platform.machine() != "x86_64" or "avx2" not in cpu_flags()):
        pytest.skip("the restricted builds run on x86-64 CPUs with AVX2 only")
    library = ctypes.CDLL(str(build_library(request.param)))
    library.kv_qk_dot_rows.argtypes = [_i64, _p, _i64, _i64, _p, _i64, _i64, _p, _i64]
    library.kv_qk_dot_rows.restype = None
    library.kv_qk_dequant_row.argtypes = [_i64, _p, _i64, _p]
    library.kv_qk_dequant_row.restype = None
    library.kv_q4_k_repack_rows.argtypes = [_p, _i64, _i64, _p, ctypes.c_int]
    library.kv_q4_k_repack_rows.restype = ctypes.c_int
    library.kv_q6_k_repack_rows.argtypes = [_p, _i64, _i64, _p, ctypes.c_int]
    library.kv_q6_k_repack_rows.restype = ctypes.c_int
    return library


def quantize_activations(x: np.ndarray) -> np.ndarray:
    """float32 [M, K] -> KvQ8Block [M, K / 32]: symmetric int8 per 32 values."""
    groups = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(groups).max(axis=-1) / np.float32(127)
    safe = np.where(d > 0, d, np.float32(1))
    q = np.clip(np.rint(groups / safe[..., None]), -127, 127).astype(np.int8)
    blocks = np.zeros(groups.shape[:2], dtype=Q8_BLOCK)
    blocks["d"] = d
    blocks["q"] = q
    blocks["s"] = d * q.astype(np.float32).sum(axis=-1)
    return blocks


def activations_of(blocks: np.ndarray) -> np.ndarray:
    """What the blocks stand for, exactly, in float64."""
    values = blocks["q"].astype(np.float64) * blocks["d"].astype(np.float64)[..., None]
    return values.reshape(blocks.shape[0], -1)


def random_blocks(qtype: GGMLQuantizationType, rows: int, K: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quants and scales, fp16 d (and dmin) of weight size."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, K // block, size), dtype=np.uint8)
    d = rng.uniform(2e-4, 2e-3, size=(rows, K // block)).astype(np.float16)
    if qtype == Q6_K:
        blocks[..., 208:210] = d[..., None].view(np.uint8)
    else:
        dmin = rng.uniform(1e-4, 2e-3, size=(rows, K // block)).astype(np.float16)
        blocks[..., 0:2] = d[..., None].view(np.uint8)
        blocks[..., 2:4] = dmin[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@functools.cache
def gemma_ffn_down_weights() -> dict[GGMLQuantizationType, np.ndarray]:
    """The first ffn_down weight of each type in the Gemma 3 270M Q4_K_M file (2048 inputs)."""
    found: dict[GGMLQuantizationType, np.ndarray] = {}
    for tensor in read_gguf(GEMMA_GGUF).tensors:
        if tensor.name.endswith("ffn_down.weight") and tensor.tensor_type not in found:
            found[tensor.tensor_type] = np.ascontiguousarray(tensor.data)
    return found


def gemma_weight(qtype: GGMLQuantizationType) -> np.ndarray:
    if not GEMMA_GGUF.exists():
        pytest.skip(f"{GEMMA_GGUF} is not here")
    weights = gemma_ffn_down_weights()
    if qtype not in weights:
        pytest.skip(f"no {qtype.name} ffn_down weight in {GEMMA_GGUF.name}")
    assert weights[qtype].shape[1] == 2048 // 256 * GGML_QUANT_SIZES[qtype][1]
    return weights[qtype]


def magnitudes(qtype: GGMLQuantizationType, data: np.ndarray, K: int) -> np.ndarray:
    """|scale part| + |minimum part| of every weight: what the kernel's float sums add up,
    which can exceed |weight| where the two cancel."""
    if qtype == Q6_K:
        return np.abs(dequantize(data, qtype).reshape(data.shape[0], K)).astype(np.float64)
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(data.shape[0], -1, size)
    scale_part, min_part = blocks.copy(), blocks.copy()
    scale_part[..., 2:4] = 0  # dmin = 0
    min_part[..., 0:2] = 0  # d = 0
    parts = [
        dequantize(p.reshape(data.shape), qtype).reshape(data.shape[0], K)
        for p in (scale_part, min_part)
    ]
    return np.abs(parts[0]).astype(np.float64) + np.abs(parts[1]).astype(np.float64)


def dot_rows(
    lib: ctypes.CDLL,
    qtype: GGMLQuantizationType,
    xq: np.ndarray,
    data: np.ndarray,
    n0: int,
    n1: int,
    ldy: int,
) -> np.ndarray:
    M, K = xq.shape[0], xq.shape[1] * 32
    xq = np.ascontiguousarray(xq)
    data = np.ascontiguousarray(data)
    y = np.full((M, ldy), np.nan, dtype=np.float32)
    lib.kv_qk_dot_rows(
        int(qtype), xq.ctypes.data, M, K, data.ctypes.data, n0, n1, y.ctypes.data, ldy
    )
    return y


def check_dot_rows(
    lib: ctypes.CDLL, qtype: GGMLQuantizationType, data: np.ndarray, K: int, M: int, seed: int
) -> None:
    N = data.shape[0]
    n0, n1, ldy = 1, N - 2, N + 3  # a range off every tile boundary, a wider output
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[0, :32] = 0  # an all-zero activation block (d = 0)
    xq = quantize_activations(x)
    y = dot_rows(lib, qtype, xq, data, n0, n1, ldy)

    w = torch.from_numpy(dequantize(data, qtype).reshape(N, K)).double()
    x_exact = torch.from_numpy(activations_of(xq))
    got = torch.from_numpy(y[:, n0:n1]).double()
    # Against the activations as quantized: only float rounding, at most one rounding per
    # step of the longest chain of sums (one per super-block, the eight sub-blocks, the
    # scale products) relative to the sum of the magnitudes added.
    mag = torch.from_numpy(magnitudes(qtype, data, K))
    rounding = (K / 256 + 16) * EPS * (x_exact.abs() @ mag.T)[:, n0:n1]
    exact = (x_exact @ w.T)[:, n0:n1]
    assert ((got - exact).abs() <= rounding).all(), (got - exact).abs().max()
    # Against the float activations (PyTorch's product): each activation is off by at most
    # half its block's step d / 2.
    step = torch.from_numpy(np.repeat(xq["d"].astype(np.float64), 32, axis=1))
    bound = (step / 2) @ w.abs().T
    reference = (torch.from_numpy(x).double() @ w.T)[:, n0:n1]
    assert ((got - reference).abs() <= bound[:, n0:n1] + rounding).all()
    # The error is of that size, not far below it: the bound is not vacuous.
    assert (got - reference).abs().max() > 1e-3 * bound[:, n0:n1].max()
    # Nothing outside the range is written.
    assert np.isnan(y[:, :n0]).all() and np.isnan(y[:, n1:]).all()


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("M", [1, 4, 5])
@pytest.mark.parametrize("K", [256, 1024])
def test_dot_rows_of_random_blocks_match_the_dequantized_product(
    lib: ctypes.CDLL, qtype: GGMLQuantizationType, M: int, K: int
) -> None:
    data = random_blocks(qtype, rows=12, K=K, seed=K + int(qtype))
    check_dot_rows(lib, qtype, data, K, M, seed=M)


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
@pytest.mark.parametrize("M", [1, 5])
def test_dot_rows_of_a_real_gguf_weight(
    lib: ctypes.CDLL, qtype: GGMLQuantizationType, M: int
) -> None:
    data = gemma_weight(qtype)[:38]
    check_dot_rows(lib, qtype, data, 2048, M, seed=7)


def test_dot_rows_of_weights_the_quantizer_wrote(lib: ctypes.CDLL) -> None:
    x = torch.randn(10, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    data = quantize_q4_k(lib, x).numpy()
    check_dot_rows(lib, Q4_K, data, 512, 4, seed=11)


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_dequant_row_equals_gguf(lib: ctypes.CDLL, qtype: GGMLQuantizationType) -> None:
    K = 768
    data = random_blocks(qtype, rows=3, K=K, seed=int(qtype))
    expected = dequantize(data, qtype).reshape(3, K)
    for row in range(3):
        out = np.full(K, np.nan, dtype=np.float32)
        lib.kv_qk_dequant_row(int(qtype), data[row].ctypes.data, K, out.ctypes.data)
        np.testing.assert_array_equal(out, expected[row])


def test_dequant_row_of_a_real_gguf_weight(lib: ctypes.CDLL) -> None:
    for qtype in (Q4_K, Q6_K):
        data = gemma_weight(qtype)[:4]
        expected = dequantize(data, qtype).reshape(4, 2048)
        out = np.empty(2048, dtype=np.float32)
        lib.kv_qk_dequant_row(int(qtype), data[2].ctypes.data, 2048, out.ctypes.data)
        np.testing.assert_array_equal(out, expected[2])


def quantizer_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 512, generator=g) * 0.02
    x[1] = 0  # all zero
    x[2] = x[2].abs() + 0.01  # no negative value: minimum 0
    x[3] = -x[3].abs() - 0.01  # all negative
    x[4, ::37] = 3.0  # outliers
    x[5] = 0.25  # constant
    x[6, :256] *= 1e-4  # one quiet super-block beside a loud one
    x[7, :16] = -5.0  # one sub-block far below the rest
    return x


def test_q4_k_quantizer_roundtrips_within_half_a_step(lib: ctypes.CDLL) -> None:
    x = quantizer_input()
    data = quantize_q4_k(lib, x).numpy()
    assert data.shape == (8, 2 * 144)
    back = dequantize(data, Q4_K).reshape(8, 512).astype(np.float64)
    values = x.numpy().astype(np.float64).reshape(8, 2, 8, 32)
    blocks = data.reshape(8, 2, 144)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)  # [8, 2, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    lowest = np.minimum(values.min(axis=-1), 0)
    highest = values.max(axis=-1)
    # The minimum is rounded up to a multiple of dmin and the step to one of d: the largest
    # error is at most half a step that covers the range, plus those two roundings.
    needed = (highest - lowest + dmin) / 15
    error = np.abs(back.reshape(values.shape) - values).max(axis=-1)
    tolerance = 1e-6 * np.abs(values).max(axis=(-1, -2), keepdims=True).squeeze(-1)
    assert (error <= (needed + d) / 2 + tolerance).all(), (error - (needed + d) / 2).max()
    # d and dmin are the smallest fp16 steps that reach the largest sub-block range and
    # minimum, so the bound above is as tight as the format allows.
    assert (d[..., 0] * 63 <= needed.max(axis=-1) * (1 + 2**-9) + 63 * 2**-24).all()
    assert (dmin[..., 0] * 63 <= -lowest.min(axis=-1) * (1 + 2**-9) + 63 * 2**-24).all()
    np.testing.assert_array_equal(back[1], 0)
    np.testing.assert_allclose(back[5], 0.25, rtol=2**-9)
    # Overall a 4-bit code of Gaussian values: about a tenth of their spread.
    rows = [0, 2, 3]
    relative = np.sqrt(((back[rows] - x.numpy()[rows]) ** 2).mean() / (x.numpy()[rows] ** 2).mean())
    assert relative < 0.12


def test_q4_k_quantizer_refuses_what_it_cannot_encode(lib: ctypes.CDLL) -> None:
    with pytest.raises(ValueError, match="K=300"):
        quantize_q4_k(lib, torch.zeros(2, 300))
    with pytest.raises(ValueError, match="float32"):
        quantize_q4_k(lib, torch.zeros(2, 256, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32"):
        quantize_q4_k(lib, torch.zeros(256))
    bad = torch.zeros(2, 256)
    bad[1, 5] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        quantize_q4_k(lib, bad)
    with pytest.raises(ValueError, match="num_threads"):
        quantize_q4_k(lib, torch.zeros(2, 256), num_threads=0)
    assert quantize_q4_k(lib, torch.zeros(0, 256)).shape == (0, 144)


# Per repackable type: the C repacker's name, the bytes of a block, the bytes kept as they
# are (Q4_K's scales at the front, Q6_K's d at the end), and Python's inverse.
REPACKING = {
    Q4_K: ("kv_q4_k_repack_rows", 144, slice(0, 16), unrepack_q4_k),
    Q6_K: ("kv_q6_k_repack_rows", 210, slice(208, 210), unrepack_q6_k),
}


def repack(lib: ctypes.CDLL, qtype: GGMLQuantizationType, data: np.ndarray, K: int) -> np.ndarray:
    data = np.ascontiguousarray(data)
    out = np.empty_like(data)
    repack_rows = getattr(lib, REPACKING[qtype][0])
    assert repack_rows(data.ctypes.data, data.shape[0], K, out.ctypes.data, 2) == 0
    return out


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_repacked_blocks_hold_the_same_values_reordered(
    lib: ctypes.CDLL, qtype: GGMLQuantizationType
) -> None:
    K = 1024
    name, size, kept, unrepack = REPACKING[qtype]
    data = random_blocks(qtype, rows=9, K=K, seed=5)
    packed = repack(lib, qtype, data, K)
    blocks, packed_blocks = data.reshape(9, -1, size), packed.reshape(9, -1, size)
    np.testing.assert_array_equal(packed_blocks[..., kept], blocks[..., kept])
    assert not np.array_equal(packed_blocks, blocks)
    # Python's inverse (what QuantWeight.dequantize reads) gives the file's bytes back.
    np.testing.assert_array_equal(unrepack(torch.from_numpy(packed)).numpy(), data)
    # The kernels read the repacked blocks as the same values.
    for row in range(9):
        out = np.full(K, np.nan, dtype=np.float32)
        lib.kv_qk_dequant_row(REPACKED_IDS[qtype], packed[row].ctypes.data, K, out.ctypes.data)
        np.testing.assert_array_equal(out, dequantize(data[row], qtype))
    assert getattr(lib, name)(data.ctypes.data, 9, 1000, packed.ctypes.data, 1) == -1


def test_repacked_q6_k_puts_each_sub_block_in_one_lane(lib: ctypes.CDLL) -> None:
    """The layout itself, from quant_k.h's description: byte 4i + t of vector V[4h + L] is
    value 4L + t of sub-block 8h + (0, 2, 4, 6, 1, 3, 5, 7)[i], its low four bits in the
    low (h = 0) or high (h = 1) nibble of byte 32L + 4i + t, its top two bits at bits 2L
    and 2L + 1 of byte 128 + 32h + 4i + t; the scales follow the same order."""
    data = random_blocks(Q6_K, rows=1, K=256, seed=8)
    packed = repack(lib, Q6_K, data, 256)[0].astype(np.int64)
    block = data[0].astype(np.int64)
    scales = block[192:208].astype(np.int8).astype(np.int64)
    d = float(np.frombuffer(data[0, 208:210].tobytes(), dtype=np.float16)[0])
    values = dequantize(data, Q6_K)[0].astype(np.float64)
    lanes = (0, 2, 4, 6, 1, 3, 5, 7)
    for h in range(2):
        for i in range(8):
            sub = 8 * h + lanes[i]
            assert packed[192 + 8 * h + i] == block[192 + sub]
            for L in range(4):
                for t in range(4):
                    b = 4 * i + t
                    q = (packed[32 * L + b] >> (4 * h)) & 15
                    q |= ((packed[128 + 32 * h + b] >> (2 * L)) & 3) << 4
                    # the stored quant is 32 above the value's multiple of d * scale
                    expected = values[16 * sub + 4 * L + t]
                    assert np.float32(np.float32(d * scales[sub]) * (q - 32)) == expected


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
@pytest.mark.parametrize("M", [1, 2, 5, 11])
def test_repacked_products_equal_the_stored_layout_bit_for_bit(
    lib: ctypes.CDLL, qtype: GGMLQuantizationType, M: int
) -> None:
    """Each sub-block's integer sum is exact in either layout and the float work is the
    same, so the two products are the same floats; the stored layout's are checked
    against the dequantized weights above. Several activation rows share each unpacked
    weight block (four at a time, against four weight rows with AVX-512 and one with
    AVX2, and the rest one at a time); every row's products are still the floats it
    gets alone."""
    K, N = 2048, 14
    for data in (random_blocks(qtype, rows=N, K=K, seed=M), gemma_weight(qtype)[:N]):
        packed = repack(lib, qtype, data, K)
        x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
        x[0, 32:48] = 0  # a Q6_K sub-block whose activations sum to zero
        xq = quantize_activations(x)
        n0, n1, ldy = 1, N - 2, N + 3  # a last tile of fewer than four rows
        stored = dot_rows(lib, qtype, xq, data, n0, n1, ldy)
        y = np.full((M, ldy), np.nan, dtype=np.float32)
        lib.kv_qk_dot_rows(
            REPACKED_IDS[qtype],
            xq.ctypes.data,
            M,
            K,
            packed.ctypes.data,
            n0,
            n1,
            y.ctypes.data,
            ldy,
        )
        np.testing.assert_array_equal(y, stored)  # NaN outside n0..n1 in both
        for m in range(M):
            alone = np.full((1, ldy), np.nan, dtype=np.float32)
            row = np.ascontiguousarray(xq[m : m + 1])
            lib.kv_qk_dot_rows(
                REPACKED_IDS[qtype],
                row.ctypes.data,
                1,
                K,
                packed.ctypes.data,
                n0,
                n1,
                alone.ctypes.data,
                ldy,
            )
            np.testing.assert_array_equal(y[m], alone[0])
