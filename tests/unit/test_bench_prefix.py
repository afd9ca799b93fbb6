"""The prefix benchmark's text generator and a tiny end-to-end run of it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvserve.benchmarks.offline import prefix
from kvserve.benchmarks.workloads.prompts import random_token_ids
from kvserve.benchmarks.workloads.text import random_text
from model_fixtures import save_tiny_model, train_tiny_tokenizer


def test_text_is_reproducible_from_its_seed_and_differs_across_seeds() -> None:
    assert random_text(random.Random(1), 8) == random_text(random.Random(1), 8)
    assert random_text(random.Random(1), 8) != random_text(random.Random(2), 8)
    assert random_text(random.Random(1), 8).count(".") == 8


def test_token_ids_have_the_exact_length_asked_for() -> None:
    tokenizer = train_tiny_tokenizer()
    for count in (1, 31, 1024):
        token_ids = random_token_ids(tokenizer, count, random.Random(count))
        assert len(token_ids) == count
        assert token_ids == random_token_ids(tokenizer, count, random.Random(count))


def test_the_benchmark_runs_and_reports_hits_only_with_caching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    args = ["--model", str(model_dir), "--num-requests", "4", "--prefix-len", "32"]
    args += ["--question-len", "4", "--output-len", "3", "--repeats", "1", "--block-size", "4"]
    assert prefix.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 3 of 4 requests hit the 32 shared tokens, out of 4 x 36 prompt tokens.
    assert report["median"]["on"]["hit_rate"] == pytest.approx(3 * 32 / (4 * 36))
    assert report["median"]["off"]["hit_rate"] == 0
    assert set(report["ratios"]) == {"total_time_speedup", "mean_ttft_speedup"}


def test_the_restart_mode_reads_the_prefix_back_from_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    args = ["--model", str(model_dir), "--prefix-len", "32", "--question-len", "4"]
    args += ["--repeats", "1", "--block-size", "4", "--dtype", "float32", "--restart"]
    assert prefix.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (run,) = report["runs"]
    assert run["cold"]["hit_tokens"] == 0
    # The 32 prefix tokens are 8 blocks: from the pool when warm, from disk after a restart.
    assert run["warm"]["hit_tokens"] == 32 and run["warm"]["disk_loads"] == 0
    assert run["restart"]["hit_tokens"] == 32 and run["restart"]["disk_loads"] == 8
    assert set(report["median_ttft_s"]) == {"cold", "warm", "restart"}
