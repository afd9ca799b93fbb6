"""kv_linear_quant's two paths, on either side of its many-row threshold, for every type.

Below the threshold the activations are rounded to int8 blocks (test_quant_kernels.py
states that bound); from it up each weight panel is dequantized once and multiplied in
floating point: bfloat16 where the build has AVX512-BF16 (x and the dequantized weight
each rounded to bfloat16, a relative 2^-9 apiece, so a product is off by at most
(2^-8 + 2^-18) |x| |w|), float32 elsewhere (rounding in the sums only). Each output is
compared with a float64 product of gguf's dequantized weight, within the bound of the
path its row count takes, for each build the library is compiled as here: this CPU's,
x86-64-v4 (AVX-512 without BF16: the float32 path), x86-64-v3 (AVX2) and baseline
x86-64. The thresholds are forced low and high; the row counts cross the default.
"""

from __future__ import annotations

import contextlib
import platform
import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from test_quant_k_kernels import magnitudes, random_blocks
from test_quant_kernels import activations, segment

from kvserve.errors import InvalidParameterError
from kvserve.kernels import NativeOps
from kvserve.kernels.build import load_library
from kvserve.kernels.quant_k_ops import quantize_q4_k
from kvserve.kernels.quant_ops import MANY_ROWS_ENV
from kvserve.kernels.quant_weight import QuantSegment, QuantWeight
from native_targets import cpu_flags

Q32_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
)
K_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
TYPES = Q32_TYPES + K_TYPES
ROW_COUNTS = (1, 7, 8, 16, 33, 64, 130)
# Weight rows: not a multiple of the 16-row (bfloat16) or 24-row (float32) panel, nor of
# the 4- and 6-row tiles.
OUT_FEATURES = 37
EPS32 = float(torch.finfo(torch.float32).eps)
NEVER = 1 << 40
BUILDS = ("native", "x86-64-v4", "x86-64-v3", "x86-64")


@pytest.fixture(scope="module", params=BUILDS)
def build(request: pytest.FixtureRequest) -> NativeOps:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    march = request.param
    if march != "native":
        needed = {"x86-64-v4": "avx512bw", "x86-64-v3": "avx2", "x86-64": "sse2"}[march]
        if platform.machine() != "x86_64" or needed not in cpu_flags():
            pytest.skip(f"{march} builds run on x86-64 CPUs with {needed}")
    lib = load_library(None if march == "native" else march)
    assert lib is not None
    return NativeOps(lib)


@contextlib.contextmanager
def many_rows_from(ops: NativeOps, rows: int) -> Iterator[None]:
    """The many-row threshold set to rows, then back to what it was (the library's
    threshold is shared by every NativeOps over it)."""
    before = ops.quant_many_rows
    ops.set_quant_many_rows(rows)
    try:
        yield
    finally:
        ops.set_quant_many_rows(before)


def has_bf16(ops: NativeOps) -> bool:
    return bool(ops.lib.kv_has_bf16_dot())


def in_features_for(qtype: GGMLQuantizationType) -> int:
    """Not a multiple of the 32 values one bfloat16 dot product takes twice over, nor of
    two K-quant super-blocks."""
    return 608 if qtype in Q32_TYPES else 768


def weight_of(qtype: GGMLQuantizationType, rows: int, seed: int) -> tuple[QuantWeight, np.ndarray]:
    """A weight of one segment, and the magnitudes the float sums add up per weight."""
    K = in_features_for(qtype)
    if qtype in Q32_TYPES:
        seg = segment(qtype, rows, K, seed)
        weight = QuantWeight(K, [seg])
        return weight, np.abs(weight.dequantize().double().numpy())
    if qtype == GGMLQuantizationType.Q4_K:
        values = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)) + 0.5
        lib = load_library()
        assert lib is not None
        data = quantize_q4_k(lib, values).numpy().reshape(rows, -1)
    else:
        data = random_blocks(qtype, rows, K, seed)
    seg = QuantSegment(qtype, rows, torch.from_numpy(np.ascontiguousarray(data)))
    return QuantWeight(K, [seg]), magnitudes(qtype, data, K)


def bound(
    ops: NativeOps, x: torch.Tensor, mags: np.ndarray, bias: torch.Tensor | None
) -> torch.Tensor:
    """The largest |kernel - float64 product| allowed at x's row count, ``[M, N]``.

    mags: per weight, what its float computation adds up (|w|, or the K-quants' scale
    and minimum parts apart). The rounding of the path taken, then float32 arithmetic as
    test_quant_kernels.py bounds it: K / 32 + 8 block terms of up to four times a block's
    largest magnitude.
    """
    M, K = x.shape
    x64, m64 = x.double().abs(), torch.from_numpy(mags)
    total = torch.zeros(M, m64.shape[0], dtype=torch.float64)
    if ops.quant_many_rows > M:
        step = x64.view(M, K // 32, 32).amax(-1) / 127
        total += ((step / 2).repeat_interleave(32, dim=1) @ m64.T) * (1 + 1e-4)
    elif has_bf16(ops):
        total += (2.0**-8 + 2.0**-17) * (x64 @ m64.T)
    block_max = m64.view(m64.shape[0], K // 32, 32).amax(-1).repeat_interleave(32, dim=1)
    total += (K // 32 + 8) * 4 * EPS32 * (x64 @ block_max.T)
    if bias is not None:
        total += 2 * EPS32 * bias.double().abs()
    return total + 1e-30


def check(
    ops: NativeOps,
    weight: QuantWeight,
    mags: np.ndarray,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> None:
    expected = x.double() @ weight.dequantize().double().T
    if bias is not None:
        expected += bias.double()
    out = ops.linear_quant(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == torch.float32
    error = (out.double() - expected).abs()
    allowed = bound(ops, x, mags, bias)
    worst = int((error / allowed).argmax())
    assert bool((error <= allowed).all()), (
        f"{x.shape[0]} rows (many-row path from {ops.quant_many_rows}): output "
        f"{divmod(worst, out.shape[1])} is off by {error.flatten()[worst]:.3g}, beyond "
        f"{allowed.flatten()[worst]:.3g}"
    )


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("threshold", ["default", "low", "high"])
def test_both_paths_match_the_dequantized_product(
    build: NativeOps, qtype: GGMLQuantizationType, threshold: str
) -> None:
    weight, mags = weight_of(qtype, OUT_FEATURES, seed=1)
    rows = {"default": build.quant_many_rows, "low": 1, "high": NEVER}[threshold]
    with many_rows_from(build, rows):
        for num_rows in ROW_COUNTS:
            x = activations(num_rows, weight.in_features, seed=num_rows)
            bias = torch.randn(OUT_FEATURES) if num_rows % 2 else None
            check(build, weight, mags, x, bias)


def test_the_many_row_path_writes_each_segment_at_its_columns(build: NativeOps) -> None:
    """Segments of both families and of sizes off the panel, in one fused weight."""
    K = 768  # a whole number of K-quant super-blocks and of 32-value blocks
    parts = [
        (segment(GGMLQuantizationType.Q5_0, 13, K, 2), None),
        (
            QuantSegment(
                GGMLQuantizationType.Q6_K,
                40,
                torch.from_numpy(random_blocks(GGMLQuantizationType.Q6_K, 40, K, 3)),
            ),
            None,
        ),
        (segment(GGMLQuantizationType.Q8_0, 17, K, 4), None),
        (
            QuantSegment(
                GGMLQuantizationType.Q5_K,
                5,
                torch.from_numpy(random_blocks(GGMLQuantizationType.Q5_K, 5, K, 5)),
            ),
            None,
        ),
    ]
    weight = QuantWeight(K, [s for s, _ in parts])
    mags = np.concatenate(
        [
            np.abs(QuantWeight(K, [s]).dequantize().double().numpy())
            if s.qtype in Q32_TYPES
            else magnitudes(s.qtype, s.data.numpy().reshape(s.rows, -1), K)
            for s, _ in parts
        ]
    )
    with many_rows_from(build, 1):
        for num_rows in (1, 9, 70):
            x = activations(num_rows, K, seed=30 + num_rows)
            check(build, weight, mags, x, torch.randn(weight.out_features))


def test_the_many_row_path_is_exact_on_values_bfloat16_holds(build: NativeOps) -> None:
    """Integer weights and activations small enough that every product and partial sum
    is exact in float32: any misplaced value or scale shows as a nonzero error."""
    rng = np.random.default_rng(7)
    K, rows = 608, 21
    values = rng.integers(-127, 128, size=(rows, K)).astype(np.float32)
    values[:, ::32] = 127.0  # each block's largest magnitude 127: Q8_0's scale is 1
    weight = QuantWeight(
        K,
        [
            QuantSegment(
                GGMLQuantizationType.Q8_0,
                rows,
                torch.from_numpy(quantize(values, GGMLQuantizationType.Q8_0)),
            )
        ],
    )
    assert torch.equal(weight.dequantize(), torch.from_numpy(values))
    x = torch.from_numpy(rng.integers(-8, 9, size=(40, K)).astype(np.float32))
    with many_rows_from(build, 1):
        out = build.linear_quant(x, weight, None)
    assert torch.equal(out.double(), x.double() @ torch.from_numpy(values).double().T)


def test_the_threshold_is_reported_settable_and_checked(build: NativeOps) -> None:
    assert build.quant_many_rows >= 1
    with many_rows_from(build, 5):
        assert build.quant_many_rows == 5
        for bad in (0, -3, 2.5, True):
            with pytest.raises(InvalidParameterError, match="rows"):
                build.set_quant_many_rows(bad)  # type: ignore[arg-type]
        assert build.quant_many_rows == 5


def test_the_environment_variable_sets_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = load_library()
    if lib is None:
        pytest.skip("no native kernels here")
    ops = NativeOps(lib)
    with many_rows_from(ops, ops.quant_many_rows):
        monkeypatch.setenv(MANY_ROWS_ENV, "48")
        assert NativeOps(lib).quant_many_rows == 48
        for bad in ("0", "-1", "many", "4.5"):
            monkeypatch.setenv(MANY_ROWS_ENV, bad)
            with pytest.raises(InvalidParameterError, match=MANY_ROWS_ENV):
                NativeOps(lib)
        assert ops.quant_many_rows == 48
