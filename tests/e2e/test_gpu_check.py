"""The GPU check's dry run: scripts/gpu_check.sh end to end on the CPU, with tiny models.

The same script the GPU machine runs, the same steps and output files; here a
step is broken on purpose, and must be recorded as failed without stopping
the others. The figures are the CPU's, so only their presence and shape are
checked, never their values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model_fixtures import train_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
OUT_FILES = {"results.json", "pytest.log", "bench.md", "steps.log", "gpu_check.log"}
FIGURES = {
    "throughput-qwen3-0.6b",
    "latency-qwen3-0.6b-graphs",
    "latency-qwen3-0.6b-eager",
    "sweep-qwen3-0.6b",
    "throughput-smollm2-135m",
}
MODELS = ("smollm2-135m", "qwen3-0.6b", "gemma2-2b")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, str]:
    """One dry run with the ``ceilings`` step broken: its exit code, $OUT and its output."""
    root = tmp_path_factory.mktemp("gpu-check")
    tokenizer = root / "tokenizer"
    train_tiny_tokenizer().save_pretrained(tokenizer)
    env = dict(
        os.environ,
        OUT=str(root / "out"),
        GPU_CHECK_WORK=str(root / "work"),
        GPU_CHECK_PYTHON=sys.executable,
    )
    env.pop("PYTHONPATH", None)
    command = ["bash", "scripts/gpu_check.sh", "--dry-run", "--tokenizer", str(tokenizer)]
    command += ["--break-step", "ceilings"]
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=540, check=False
    )
    return done.returncode, root / "out", done.stdout + done.stderr


@pytest.fixture(scope="module")
def results(dry_run: tuple[int, Path, str]) -> dict[str, Any]:
    return json.loads((dry_run[1] / "results.json").read_text())


def test_a_broken_step_fails_the_run_but_stops_nothing(
    dry_run: tuple[int, Path, str], results: dict[str, Any]
) -> None:
    exit_code, out, output = dry_run
    assert exit_code == 1, output
    assert {p.name for p in out.iterdir()} == OUT_FILES
    statuses = {step["name"]: step["status"] for step in results["steps"]}
    assert statuses.pop("ceilings") == "error"
    assert set(statuses.values()) == {"passed"}, results["steps"]
    broken = next(step for step in results["steps"] if step["name"] == "ceilings")
    assert "broken on purpose" in broken["reason"]
    assert results["summary"] == {"passed": len(statuses), "error": 1, "ok": False}
    assert "NOT all passed" in output


def test_every_section_has_its_results(results: dict[str, Any]) -> None:
    assert results["dry_run"] is True and results["device"] == "cpu"
    assert results["env"]["torch"] and not results["env"]["missing_modules"]
    tests = results["tests"]
    assert "tests/engine/test_flex_cuda.py" in tests["files"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # no CUDA here
    for name in MODELS:
        model = results["models"]["models"][name]
        assert model["tiny"] and model["parameters"] > 0 and model["weights_bytes"] > 0
    assert set(results["figures"]) == FIGURES
    assert all(figure["exit_code"] == 0 for figure in results["figures"].values())


def test_parity_went_through_preemption_and_prefix_hits(results: dict[str, Any]) -> None:
    assert set(results["parity"]) == {f"parity-{name}" for name in MODELS}
    for step, parity in results["parity"].items():
        assert parity["status"] == "passed"
        for dtype, runs in parity["dtypes"].items():
            tolerance = parity["tolerances"][dtype]
            for run, entry in runs.items():
                if run.endswith("_vs_cpu"):
                    assert entry["diverged_decisively"] == 0
                    continue
                assert entry["positions"] > 0 and entry["max_error"] <= tolerance, (step, run)
                assert entry["mismatched_tokens"] == 0 and entry["decisive_positions"] > 0
                assert entry["preemptions"] > 0
                # Gemma 2's sliding layers turn prefix caching off.
                assert entry["prefix_caching"] == (step != "parity-gemma2-2b")
                assert (entry["wave3_prefix_hit_tokens"] > 0) == entry["prefix_caching"]
    # Each code path once: bfloat16 (with its drift from float32) and the CPU reference.
    smollm2 = results["parity"]["parity-smollm2-135m"]["dtypes"]
    assert smollm2["bfloat16"]["eager"]["reference_error_vs_float32"] > 0
    assert smollm2["float32"]["eager_vs_cpu"]["identical_requests"] == 11


def test_the_figures_and_goals_are_filled(
    results: dict[str, Any], dry_run: tuple[int, Path, str]
) -> None:
    figures = results["figures"]
    throughput = figures["throughput-qwen3-0.6b"]
    assert throughput["kvserve_output_tok_per_s"] > 0 and throughput["speedup_vs_hf_static"] > 0
    assert any("--baseline-requests" in note for note in throughput["notes"])
    assert figures["latency-qwen3-0.6b-eager"]["ms_per_token"] > 0
    assert figures["latency-qwen3-0.6b-graphs"]["hf_generate_ms_per_token"] > 0
    points = figures["sweep-qwen3-0.6b"]["points"]
    assert sorted(points, key=int) == ["1", "2"]
    for point in points.values():
        assert 0 < point["decode_step_host_ms"] <= point["decode_step_ms"] * 1.001
        assert point["decode_step_floor_ms"] > 0 and point["step_over_floor"] > 0
    assert all("compiles" in figure["flex_compiles"] for figure in figures.values())
    assert [goal["value"] is not None for goal in results["goals"]] == [True, True, True]
    bench = (dry_run[1] / "bench.md").read_text()
    assert "## Goals" in bench and "## Parity" in bench and "not GPU figures" in bench
    assert all(f"## {name} (passed)" in bench for name in FIGURES)
    assert "skipped" in (dry_run[1] / "pytest.log").read_text()


def test_the_decode_profile_covers_each_run(
    results: dict[str, Any], dry_run: tuple[int, Path, str]
) -> None:
    # On the CPU there are no kernels; the host's operations and the step times are there.
    runs = results["profile"]["runs"]
    assert set(runs) == {"1x16", "4x16", "4x64"}
    for run in runs.values():
        assert run["steps"] == 5 and run["wall_ms"] > 0 and run["device_wait_ms"] == 0
        assert run["top_host_ops"] and all(op["ms"] >= 0 for op in run["top_host_ops"])
    bench = (dry_run[1] / "bench.md").read_text()
    assert "## Decode steps profiled" in bench
    assert "4 sequences, KV blocks of 64 tokens" in bench
