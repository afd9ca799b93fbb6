"""``kvserve bench throughput`` end to end on a tiny model, against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import EXIT_INTERRUPTED, main
from model_fixtures import save_tiny_model, train_tiny_tokenizer


def test_each_system_is_printed_and_saved_as_it_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(model_dir), "--num-requests", "5"]
    argv += ["--input-len", "8", "16", "--output-len", "2", "5", "--repetitions", "1"]
    argv += ["--baselines", "static", "continuous", "--hf-batch-size", "2", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # Each system's line comes before the final table, kvserve's first.
    kvserve_line = printed.index("kvserve: ")
    static_line = printed.index("hf_static: ")
    continuous_line = printed.index("hf_continuous: ")
    assert kvserve_line < static_line < continuous_line < printed.index("system  ")
    report = json.loads(out.read_text())
    assert report["complete"] is True
    assert report["notes"] == []
    assert set(report["results"]) == {"kvserve", "hf_static", "hf_continuous"}
    for metrics in report["results"].values():
        # Rates follow from the same workload and each system's own wall time.
        assert metrics["requests_per_s"] == pytest.approx(5 / metrics["wall_s"])
        assert metrics["peak_rss_gib"] > 0
    assert report["results"]["kvserve"]["peak_kv_blocks"] > 0
    assert report["results"]["kvserve"]["peak_kv_mib"] > 0


def test_a_stopped_run_keeps_the_systems_that_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvserve.benchmarks.baselines import hf_baseline

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_baseline, "static_batching", stopped)
    model_dir = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(model_dir), "--num-requests", "3"]
    argv += ["--input-len", "8", "12", "--output-len", "2", "3", "--repetitions", "1"]
    argv += ["--baselines", "static", "--json", str(out)]
    assert main(argv) == EXIT_INTERRUPTED
    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert list(report["results"]) == ["kvserve"]


def test_data_parallel_engines_share_the_requests_and_skip_the_baselines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(model_dir), "--num-requests", "5"]
    argv += ["--input-len", "8", "16", "--output-len", "2", "5", "--repetitions", "1"]
    argv += ["--data-parallel-size", "2", "--json", str(out)]
    assert main(argv) == 0
    assert "2 engines x 1 thread(s)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["kvserve"]
    metrics = report["results"]["kvserve"]
    # Every request ran (each engine checks its output lengths) within the slowest's wall time.
    assert metrics["requests_per_s"] == pytest.approx(5 / metrics["wall_s"])
    assert metrics["peak_kv_blocks"] > 0
