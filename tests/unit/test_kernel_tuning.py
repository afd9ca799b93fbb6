"""The quantized kernels' many-row threshold, measured on the machine (kernels/tuning.py).

The choice rule and the cache are checked on made-up timings; one test measures a real
model's first layer and checks the choice is applied and kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve.kernels import NativeOps, native_ops, tuning
from kvserve.kernels.quant_weight import QuantSegment, QuantWeight, row_bytes
from kvserve.kernels.tuning import (
    CANDIDATE_ROWS,
    NEVER,
    SETTLED_WINS,
    TuningCache,
    crossover,
    first_layer,
    measure,
    stream_bytes,
    tune_quant_many_rows,
    tune_stream_prefetch,
    tune_x8_wide,
)
from kvserve.worker.platform import cpu as cpu_platform


def test_crossover_is_where_the_many_row_path_stays_ahead() -> None:
    # (many-row seconds, int8 seconds): a noisy early win at 4 does not count.
    timings = {2: (3.0, 1.0), 4: (0.9, 1.0), 8: (1.2, 1.0), 12: (1.0, 1.0), 16: (0.5, 1.0)}
    assert crossover(timings) == 12
    assert crossover({2: (0.1, 1.0), 4: (0.1, 1.0)}) == 2
    assert crossover({2: (2.0, 1.0), 4: (0.5, 1.0), 8: (1.5, 1.0)}) == NEVER


def test_measure_times_both_paths_and_stops_once_the_many_row_path_has_settled() -> None:
    """A fake kernel whose cost depends on the threshold in force: the int8 path costs 10
    per row, the many-row path 100 plus 1 per row, so it wins from 12 rows up."""
    state = {"threshold": 0, "now": 0.0}
    calls: list[int] = []

    def set_rows(rows: int) -> None:
        state["threshold"] = rows

    def linear(x: torch.Tensor, weight: object) -> None:
        rows = x.shape[0]
        calls.append(rows)
        state["now"] += 100 + rows if rows >= state["threshold"] else 10 * rows

    class Weight:
        in_features = 32

    timings = measure(linear, set_rows, [Weight()], clock=lambda: state["now"])
    assert crossover(timings) == 12
    assert timings[8] == (108, 80) and timings[16] == (116, 160)
    # It stopped SETTLED_WINS counts after the first win.
    measured = sorted(timings)
    assert measured[-1] == CANDIDATE_ROWS[CANDIDATE_ROWS.index(12) + SETTLED_WINS - 1]
    assert set(calls) == set(measured)


def test_the_cache_keeps_choices_and_ignores_what_it_cannot_trust(tmp_path: Path) -> None:
    cache = TuningCache.for_library(tmp_path / "kvserve_kernels-abc.so")
    assert cache.path.name == "kvserve_kernels-abc.tuning.json"
    assert cache.get("k") is None
    cache.put("k", 24, {24: (0.5, 1.0)})
    cache.put("other", 8, {})
    assert cache.get("k") == 24 and cache.get("other") == 8
    document = json.loads(cache.path.read_text())
    assert document["entries"]["k"]["timings_s"] == {"24": [0.5, 1.0]}
    os.chmod(cache.path, 0o666)  # writable by others: not trusted
    assert cache.get("k") is None
    os.chmod(cache.path, 0o600)
    cache.path.write_text("{not json")
    assert cache.get("k") is None
    cache.path.write_text(json.dumps({"version": 999, "entries": {"k": {"quant_many_rows": 4}}}))
    assert cache.get("k") is None
    cache.path.write_text(
        json.dumps({"version": tuning.FORMAT_VERSION, "entries": {"k": {"quant_many_rows": 0}}})
    )
    assert cache.get("k") is None


def test_a_choice_is_measured_once_per_thread_count_then_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "machine_busy", lambda: False)
    cache = TuningCache(tmp_path / "t.tuning.json")
    applied: list[int] = []
    measured: list[int] = []

    def fake_measure(linear: object, set_rows: object, weights: object) -> dict:
        measured.append(1)
        return {8: (2.0, 1.0), 16: (0.5, 1.0)}

    weights = [_weight()]
    first = tune_quant_many_rows(None, applied.append, weights, cache, 2, fake_measure)
    assert (first.rows, first.source, applied[-1]) == (16, "measured", 16)
    again = tune_quant_many_rows(None, applied.append, weights, cache, 2, fake_measure)
    assert (again.rows, again.source, len(measured), applied[-1]) == (16, "cached", 1, 16)
    assert again == tuning.LAST_CHOICE and "from 16 rows" in again.describe()
    tune_quant_many_rows(None, applied.append, weights, cache, 1, fake_measure)
    assert len(measured) == 2


def _weight() -> QuantWeight:
    qtype = GGMLQuantizationType.Q8_0
    data = torch.zeros(4, row_bytes(qtype, 64), dtype=torch.uint8)
    return QuantWeight(64, [QuantSegment(qtype, 4, data)])


def test_first_layer_takes_the_first_numbered_layer() -> None:
    a, b, c, d = (_weight() for _ in range(4))
    named = [("model.layers.0.qkv", a), ("model.layers.0.down", b), ("model.layers.1.qkv", c)]
    assert first_layer(named) == [a, b]
    assert first_layer([("lm_head", d)]) == [d]


def test_loading_a_quantized_model_measures_and_applies_the_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2's Q4_1 file through the CPU plan: the choice is one of the measured counts
    (or never), in force in the kernels, and read back from the cache the second time."""
    from kvserve.llm import LLM
    from kvserve.worker.platform.cpu import tune_quantized_kernels

    monkeypatch.setenv("KVSERVE_KERNEL_TUNING", "1")
    monkeypatch.setattr(tuning, "machine_busy", lambda: False)
    monkeypatch.setattr(
        TuningCache, "for_library", classmethod(lambda cls, lib: cls(tmp_path / "t.json"))
    )
    ops = native_ops()
    if ops is None:
        pytest.skip("the C kernels do not build here")
    before, before_nta = ops.quant_many_rows, ops.quant_stream_nta
    before_wide = ops.quant_x8_wide_rows
    try:
        llm = LLM("smollm2-135m-instruct", max_model_len=256, num_blocks=16)
        engine_ops = llm.llm_engine.runner.plan.ops
        assert engine_ops is not None and engine_ops.lib is ops.lib
        choice, stream = tuning.LAST_CHOICE, tuning.LAST_STREAM
        assert choice is not None and choice.source == "measured"
        assert choice.rows in CANDIDATE_ROWS or choice.rows == NEVER
        assert engine_ops.quant_many_rows == choice.rows
        again = tune_quantized_kernels(llm.llm_engine.runner.model, engine_ops)
        assert again is not None and (again.source, again.rows) == ("cached", choice.rows)
        # Q4_1 is a block-32 type: how its stream is prefetched was measured too.
        assert stream is not None and set(stream.timings) == {"nta", "l2"}
        assert engine_ops.quant_stream_nta == stream.nta
        assert stream.nta == (stream.timings["nta"] <= stream.timings["l2"])
        cached = tuning.LAST_STREAM
        assert cached is not None and (cached.source, cached.nta) == ("cached", stream.nta)
        # Where the build has 512-bit tiles, from which row count to use them was measured.
        wide = tuning.LAST_WIDE
        if engine_ops.x8_wide_built:
            assert wide is not None and wide.source == "cached"
            assert wide.rows in tuning.WIDE_ROWS or wide.rows == NEVER
            assert engine_ops.quant_x8_wide_rows == wide.rows
    finally:
        ops.set_quant_many_rows(before)
        ops.set_quant_stream_nta(before_nta)
        ops.set_quant_x8_wide_rows(before_wide)


def test_a_measurement_on_a_busy_machine_is_used_but_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    assert tuning.machine_busy()
    cache = TuningCache(tmp_path / "t.tuning.json")
    applied: list[int] = []
    choice = tune_quant_many_rows(
        None, applied.append, [_weight()], cache, 2, lambda *_: {8: (0.5, 1.0)}
    )
    assert (choice.rows, applied) == (8, [8])
    assert not cache.path.exists()
    monkeypatch.setattr(tuning.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert not tuning.machine_busy()


def test_the_prefetch_choice_is_the_faster_one_measured_once_per_thread_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream whose passes take longer with non-temporal prefetches gets prefetches into
    L2; the choice is applied, kept, and read back without measuring again."""
    monkeypatch.setattr(tuning, "machine_busy", lambda: False)
    cache = TuningCache(tmp_path / "t.tuning.json")
    state = {"nta": True}
    applied: list[bool] = []
    made: list[int] = []
    now = [0.0]

    def set_nta(nta: bool) -> None:
        state["nta"] = nta
        applied.append(nta)

    def linear(x: torch.Tensor, weight: QuantWeight) -> None:
        now[0] += 2.0 if state["nta"] else 1.0

    def make_stream() -> QuantWeight:
        made.append(1)
        return _weight()

    measure_stream = tuning.measure_stream
    monkeypatch.setattr(
        tuning,
        "measure_stream",
        lambda *args: measure_stream(*args, clock=lambda: now[0]),
    )
    first = tune_stream_prefetch(linear, set_nta, make_stream, cache, 2)
    assert (first.nta, first.source, applied[-1]) == (False, "measured", False)
    assert first.timings == {"nta": 2.0, "l2": 1.0} and "into L2" in first.describe()
    again = tune_stream_prefetch(linear, set_nta, make_stream, cache, 2)
    assert (again.nta, again.source, len(made), applied[-1]) == (False, "cached", 1, False)
    assert again == tuning.LAST_STREAM
    tune_stream_prefetch(linear, set_nta, make_stream, cache, 1)
    assert len(made) == 2


def test_the_wide_tiles_are_used_from_where_they_were_measured_no_slower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wide tiles slower for one row and faster from two: used from two rows; the choice
    is applied, kept, and read back without measuring again."""
    monkeypatch.setattr(tuning, "machine_busy", lambda: False)
    cache = TuningCache(tmp_path / "t.tuning.json")
    state = {"from": 1}
    applied: list[int] = []
    now = [0.0]

    def set_rows(rows: int) -> None:
        state["from"] = rows
        applied.append(rows)

    def linear(x: torch.Tensor, weight: QuantWeight) -> None:
        wide = x.shape[0] >= state["from"]
        now[0] += (1.5 if wide else 1.0) if x.shape[0] == 1 else (1.0 if wide else 2.0)

    def clocked(*args: object, candidates: object) -> dict:
        return measure(*args, clock=lambda: now[0], candidates=candidates)  # type: ignore[arg-type]

    weights = [_weight()]
    first = tune_x8_wide(linear, set_rows, weights, cache, 2, clocked)
    assert (first.rows, first.source, applied[-1]) == (2, "measured", 2)
    assert first.timings[1] == (1.5, 1.0) and first.timings[2] == (1.0, 2.0)
    assert "from 2 rows" in first.describe()
    again = tune_x8_wide(linear, set_rows, weights, cache, 2, clocked)
    assert (again.rows, again.source, applied[-1]) == (2, "cached", 2)
    assert again == tuning.LAST_WIDE
    never = tune_x8_wide(linear, set_rows, weights, cache, 1, lambda *a, **k: {8: (2.0, 1.0)})
    assert (never.rows, applied[-1]) == (NEVER, NEVER) and "never" in never.describe()


def test_the_measuring_stream_is_larger_than_the_caches() -> None:
    assert 128 << 20 <= stream_bytes() <= 512 << 20


def test_the_measuring_stream_is_made_in_the_kernels_layout(
    ops: NativeOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q8_0_stream skips laying out a GGUF copy: its weight is what kernel_layout makes
    of the same zeros, byte for byte and type for type, and it multiplies to zeros."""
    monkeypatch.setattr(cpu_platform, "stream_bytes", lambda: 1 << 20)
    stream = cpu_platform.q8_0_stream(ops)
    (segment,) = stream.segments
    assert segment.rows * segment.data.shape[1] <= 1 << 20 and segment.rows % 8 == 0
    zeros = torch.zeros_like(segment.data)
    laid = ops.kernel_layout(
        QuantWeight(stream.in_features, [QuantSegment(segment.qtype, segment.rows, zeros)])
    )
    assert segment.kernel_type == laid.segments[0].kernel_type
    assert segment.repacked == laid.segments[0].repacked
    assert torch.equal(segment.data, laid.segments[0].data)
    out = ops.linear_quant(torch.randn(3, stream.in_features), stream, None)
    assert torch.equal(out, torch.zeros(3, segment.rows))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1])
def test_the_prefetch_setting_leaves_every_product_unchanged(
    qtype: GGMLQuantizationType,
) -> None:
    from gguf.quants import quantize

    ops = native_ops()
    if ops is None:
        pytest.skip("the C kernels do not build here")
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(64, 512, generator=generator).numpy()
    segment = QuantSegment(qtype, 64, torch.from_numpy(quantize(values, qtype)))
    weight = ops.kernel_layout(QuantWeight(512, [segment]))
    x = torch.randn(3, 512, generator=generator)
    before = ops.quant_stream_nta
    try:
        results = []
        for nta in (True, False):
            ops.set_quant_stream_nta(nta)
            assert ops.quant_stream_nta is nta
            results.append([ops.linear_quant(x[:m], weight, None) for m in (1, 3)])
        for with_nta, without in zip(*results, strict=True):
            assert torch.equal(with_nta, without)
    finally:
        ops.set_quant_stream_nta(before)


def test_float32_weights_go_to_blas_from_the_measured_crossover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real float32 layer with the C kernels: the measured choice is applied (the
    kernel below it, BLAS from it, each product close to F.linear), kept and read back."""
    from torch.nn import functional as F

    from kvserve.layers import weight_format
    from kvserve.layers.linear import Linear
    from kvserve.worker.cpu_weights import use_linear_kernels
    from kvserve.worker.platform.cpu import tune_float_kernels

    ops = native_ops()
    if ops is None:
        pytest.skip("the C kernels do not build here")
    monkeypatch.setenv("KVSERVE_KERNEL_TUNING", "1")
    monkeypatch.setattr(tuning, "machine_busy", lambda: False)
    library = tmp_path / "kvserve_kernels-test.so"
    monkeypatch.setattr(ops.lib, "_name", str(library))
    before = weight_format.f32_blas_rows()
    layer = torch.nn.Module()
    layer.proj = Linear(64, 96, bias=True, dtype=torch.float32)  # type: ignore[assignment]
    torch.nn.init.normal_(layer.proj.weight)
    use_linear_kernels(layer, ops)
    kernel_calls: list[int] = []
    real_linear = ops.linear

    def counting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel_calls.append(x.shape[0])
        return real_linear(x, weight, bias)

    monkeypatch.setattr(ops, "linear", counting)
    try:
        first = tune_float_kernels(layer, ops)
        assert first is not None and first.source == "measured" and first.timings
        assert weight_format.f32_blas_rows() == first.rows
        again = tune_float_kernels(layer, ops)
        assert again is not None and (again.rows, again.source) == (first.rows, "cached")
        assert again == tuning.LAST_BLAS
        entry = json.loads((tmp_path / "kvserve_kernels-test.tuning.json").read_text())
        assert any(key.startswith("f32blas;") for key in entry["entries"])
        weight_format.set_f32_blas_rows(8)
        with torch.inference_mode():
            for rows in (7, 8):
                kernel_calls.clear()
                x = torch.randn(rows, 64)
                out = layer.proj(x)
                assert kernel_calls == ([7] if rows == 7 else [])
                want = F.linear(x, layer.proj.weight, layer.proj.bias)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    finally:
        weight_format.set_f32_blas_rows(before)
