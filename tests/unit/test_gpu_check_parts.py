"""The GPU check's parts: step selection and isolation, comparisons, goals, wheels, shapes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvserve.benchmarks.gpu_check import compare, driver, figures, prepare, report, steps
from kvserve.benchmarks.gpu_check.context import Context, Step
from kvserve.benchmarks.gpu_check.models import SHAPES, parameter_count, shape_config

REPO = Path(__file__).resolve().parents[2]


def _passes(ctx: Context) -> dict[str, Any]:
    return {"value": 1}


def _finds_a_problem(ctx: Context) -> dict[str, Any]:
    return {"problems": ["it is wrong"]}


def _hangs(ctx: Context) -> dict[str, Any]:
    time.sleep(60)
    return {}


def _reads_earlier_results(ctx: Context) -> dict[str, Any]:
    return {"seen": ctx.results["first"]["value"]}


FAKE_STEPS = [
    Step("first", "env", _passes, 10),
    Step("wrong", "tests", _finds_a_problem, 10),
    Step("hangs", "figures", _hangs, 1.0),
    Step("after-wrong", "figures", _passes, 10, needs=("wrong",)),
    Step("reads", "parity", _reads_earlier_results, 10, needs=("first",)),
]


def test_each_step_runs_apart_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steps, "STEPS", FAKE_STEPS)
    monkeypatch.setattr(driver, "PRELOAD", ())  # already imported, and slow to check
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--dry-run"]
    assert driver.main([*argv, "--deadline-s", "30"]) == 1
    results = json.loads((out / "results.json").read_text())
    status = {s["name"]: (s["status"], s.get("reason", "")) for s in results["steps"]}
    assert status["first"] == ("passed", "")
    assert status["wrong"] == ("failed", "it is wrong")
    assert status["hangs"][0] == "timeout"  # killed after its budget (halved: a dry run)
    assert status["after-wrong"] == ("skipped", "needs wrong, which did not pass")
    assert status["reads"] == ("passed", "")
    assert results["parity"]["reads"]["seen"] == 1
    assert results["summary"] == {"passed": 2, "failed": 1, "timeout": 1, "skipped": 1, "ok": False}
    assert "===== hangs: timeout" in (out / "steps.log").read_text()


def test_resume_keeps_the_verdicts_and_runs_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steps, "STEPS", FAKE_STEPS)
    monkeypatch.setattr(driver, "PRELOAD", ())
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--dry-run"]
    driver.main([*argv, "--only", "first,wrong"])
    assert driver.main([*argv, "--resume", "--skip", "hangs"]) == 1
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    steps_ = {s["name"]: s for s in results["steps"]}
    assert steps_["first"]["resumed"] and steps_["wrong"]["resumed"]
    assert steps_["wrong"]["status"] == "failed"
    assert steps_["after-wrong"]["reason"] == "needs wrong, which did not pass"
    # The kept result of "first" is there for the step that reads it.
    assert "resumed" not in steps_["reads"] and results["parity"]["reads"]["seen"] == 1


def test_only_takes_what_the_steps_need_and_skip_leaves_out() -> None:
    assert driver.selected(FAKE_STEPS, "reads", "") == {"reads", "first"}
    assert driver.selected(FAKE_STEPS, "", "hangs,wrong") == {"first", "after-wrong", "reads"}
    with pytest.raises(SystemExit, match="unknown steps: nope"):
        driver.selected(FAKE_STEPS, "nope", "")


def test_the_cuda_tests_are_found_by_their_skip_reason() -> None:
    assert "tests/engine/test_flex_cuda.py" in steps.cuda_test_files(REPO)
    xml = '<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="5">'
    assert steps.junit_counts(xml) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2}


def test_the_shapes_are_the_published_ones() -> None:
    assert parameter_count(shape_config("smollm2-135m", tiny=False)) == pytest.approx(
        134.5e6, rel=0.01
    )
    assert parameter_count(shape_config("qwen3-0.6b", tiny=False)) == pytest.approx(596e6, rel=0.01)
    assert parameter_count(shape_config("gemma2-2b", tiny=False)) == pytest.approx(2.61e9, rel=0.01)
    for name in SHAPES:
        tiny = shape_config(name, tiny=True)
        assert tiny["model_type"] == SHAPES[name]["model_type"] and tiny["num_hidden_layers"] == 2
    assert shape_config("gemma2-2b", tiny=True)["attn_logit_softcapping"] == 50.0


def test_logprobs_and_tokens_are_compared_with_the_reference() -> None:
    torch = pytest.importorskip("torch")
    reference = torch.tensor([[0.0, -3.0, -5.0], [-1.0, -1.001, -6.0]]).log_softmax(-1)
    ours = {
        "requests": [
            {
                "tokens": [0, 1],  # the second is a near-tie: not a mismatch
                "logprobs": [
                    {0: float(reference[0, 0]), 1: float(reference[0, 1]) + 0.01},
                    {1: float(reference[1, 1]), 0: float(reference[1, 0])},
                ],
            }
        ]
    }
    found = compare.compare(ours, [reference], tolerance=0.1)
    assert found["max_error"] == pytest.approx(0.01, abs=1e-5)
    assert (found["decisive_positions"], found["mismatched_tokens"]) == (1, 0)
    ours["requests"][0]["tokens"] = [1, 1]
    assert compare.compare(ours, [reference], tolerance=0.1)["mismatched_tokens"] == 1


def test_a_gpu_run_may_leave_the_cpu_only_at_a_near_tie() -> None:
    cpu = {"requests": [{"tokens": [5, 6], "logprobs": [{5: -0.1}, {6: -0.70, 7: -0.701}]}]}
    gpu = {"requests": [{"tokens": [5, 7], "logprobs": [{5: -0.1005}, {7: -0.70}]}]}
    found = compare.agreement(gpu, cpu, tolerance=0.01)
    assert found["diverged_at_near_ties"] == 1 and found["diverged_decisively"] == 0
    assert found["max_error_before_divergence"] == pytest.approx(0.0005)
    cpu["requests"][0]["logprobs"][1] = {6: -0.1, 7: -3.0}
    assert compare.agreement(gpu, cpu, tolerance=0.01)["diverged_decisively"] == 1


def test_goals_read_the_figures() -> None:
    figures_ = {
        "throughput-qwen3-0.6b": {"speedup_vs_hf_static": 12.0},
        "latency-qwen3-0.6b-graphs": {"ms_per_token": 2.0},
        "latency-qwen3-0.6b-eager": {"ms_per_token": 5.0},
        "sweep-qwen3-0.6b": {
            "points": {"16": {"step_over_floor": 9.0}, "256": {"step_over_floor": 4.0}}
        },
    }
    assert [(g["value"], g["met"]) for g in report.goals(figures_)] == [
        (12.0, True),
        (2.5, False),
        (4.0, False),
    ]
    assert [g["met"] for g in report.goals({})] == [None, None, None]


def test_the_device_runs_the_nano_vllm_workload(tmp_path: Path) -> None:
    ctx = Context(REPO, tmp_path, tmp_path, dry_run=False, tokenizer=tmp_path)
    ctx.results["models"] = {"models": {"qwen3-0.6b": {"path": "/m/qwen3"}}}
    argv = " ".join(figures.bench_argv(ctx, "throughput-qwen3-0.6b"))
    assert "--model /m/qwen3 --device cuda --num-requests 256" in argv
    assert "--input-len 100 1024 --output-len 100 1024" in argv
    eager = figures.bench_argv(ctx, "latency-qwen3-0.6b-eager")
    assert "--enforce-eager" in eager and "--no-baselines" in eager


def test_every_device_command_parses(tmp_path: Path) -> None:
    from kvserve.cli import build_parser

    ctx = Context(REPO, tmp_path, tmp_path, dry_run=False, tokenizer=tmp_path)
    ctx.results["models"] = {"models": {name: {"path": f"/m/{name}"} for name in SHAPES}}
    for name in figures.BENCHES:
        args = build_parser().parse_args(figures.bench_argv(ctx, name))
        assert args.device == "cuda" and args.json.endswith(f"{name}.json")
    sweep = build_parser().parse_args(figures.bench_argv(ctx, "sweep-qwen3-0.6b"))
    assert (sweep.concurrency, sweep.num_blocks) == ([1, 16, 64, 256], 12288)


def test_only_wheels_the_python_lacks_or_has_older_are_installed(tmp_path: Path) -> None:
    for name in ("pytest-0.1-py3-none-any.whl", "pytest-9999.0-py3-none-any.whl"):
        (tmp_path / name).touch()
    (tmp_path / "no_such_distribution-1.0-py3-none-any.whl").touch()
    assert [p.name for p in prepare.needed_wheels(tmp_path)] == [
        "no_such_distribution-1.0-py3-none-any.whl",
        "pytest-9999.0-py3-none-any.whl",
    ]
    assert all("==" in pin for pin in prepare.pins())
