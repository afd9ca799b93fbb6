"""A tiny end-to-end run of ``kvserve bench structured``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.benchmarks.offline import structured
from kvserve.benchmarks.workloads.structured_schemas import SCHEMAS
from model_fixtures import save_tiny_model, train_tiny_tokenizer


def test_the_benchmark_runs_both_batches_and_reports_compiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model(tmp_path / "model", "llama", train_tiny_tokenizer())
    parser = argparse.ArgumentParser()
    structured.register(parser.add_subparsers())
    argv = ["structured", "--model", str(model_dir), "--batch-sizes", "2", "--prompt-len", "4"]
    argv += ["--output-len", "6", "--repetitions", "1", "--schema-repeats", "3"]
    argv += ["--json", str(tmp_path / "out.json"), "--block-size", "4"]
    args = parser.parse_args(argv)
    assert args.run(args) == 0
    assert "half JSON tok/s" in capsys.readouterr().out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["batches"]["2"]["mixed"] > 0 and report["batches"]["2"]["unconstrained"] > 0
    # Twenty schemas, three times each: the first request of each compiles, the rest hit.
    assert report["compile"]["cache_hit_rate"] == pytest.approx(2 / 3)
    assert 0 < report["compile"]["compile_median_ms"] <= report["compile"]["compile_max_ms"]


def test_the_validity_run_counts_valid_answers_per_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model(tmp_path / "model", "llama", train_tiny_tokenizer())
    parser = argparse.ArgumentParser()
    structured.register(parser.add_subparsers())
    argv = ["structured", "--model", str(model_dir), "--validity", "--max-tokens", "6"]
    argv += ["--json", str(tmp_path / "out.json"), "--block-size", "4"]
    args = parser.parse_args(argv)
    assert args.run(args) == 0
    assert "valid JSON within 6 tokens (strict=true): greedy " in capsys.readouterr().out
    report = json.loads((tmp_path / "out.json").read_text())
    for mode in ("greedy", "sampled"):
        assert set(report[mode]) == set(SCHEMAS)
        valid = [case["valid"] for case in report[mode].values()]
        assert report["valid"][mode] == sum(valid)
        # Six tokens end few answers: most of a random model's JSON is cut off, invalid.
        assert sum(valid) < len(SCHEMAS) // 2
