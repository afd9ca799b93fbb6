"""The end of a run: results.json's sections, the goals, the summary, and bench.md.

Goals (docs/cuda.md): kvserve's output throughput at least 10x transformers'
static batching on the nano-vllm workload; CUDA graphs at least 3x faster
than eager decoding at batch 1; at 256 sequences a decode step within 3x of
its floor. A goal whose figures are missing is "not measured".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.benchmarks.gpu_check import profile_decode

Figures = dict[str, dict[str, Any]]


def _throughput(figures: Figures) -> float | None:
    return figures.get("throughput-qwen3-0.6b", {}).get("speedup_vs_hf_static")


def _graphs(figures: Figures) -> float | None:
    graphs = figures.get("latency-qwen3-0.6b-graphs", {}).get("ms_per_token")
    eager = figures.get("latency-qwen3-0.6b-eager", {}).get("ms_per_token")
    return eager / graphs if graphs and eager else None


def _floor(figures: Figures) -> float | None:
    points = figures.get("sweep-qwen3-0.6b", {}).get("points") or {}
    if not points:
        return None
    return points[max(points, key=int)]["step_over_floor"]


# (goal, how its figure reads, figure, target, True when the figure must reach at least it)
GOALS: list[tuple[str, str, Callable[[Figures], float | None], float, bool]] = [
    (
        "throughput vs transformers static batching, nano-vllm workload, Qwen3-0.6B shape",
        "x",
        _throughput,
        10.0,
        True,
    ),
    ("batch-1 decode: eager ms/token over CUDA graphs' ms/token", "x", _graphs, 3.0, True),
    ("decode step at the most sequences (256) over its floor", "x", _floor, 3.0, False),
]


def goals(figures: Figures) -> list[dict[str, Any]]:
    rows = []
    for name, unit, figure, target, at_least in GOALS:
        value = figure(figures)
        met = None if value is None else (value >= target if at_least else value <= target)
        rows.append(
            {
                "goal": name,
                "value": value,
                "target": f"{'>=' if at_least else '<='} {target:g}{unit}",
                "met": met,
            }
        )
    return rows


def summarise(doc: dict[str, Any], results: dict[str, dict[str, Any]], out: Path) -> None:
    """Fill ``doc``'s sections from the step ``results``, the goals and the summary; write
    bench.md."""
    for entry in doc["steps"]:
        section, name = entry["section"], entry["name"]
        result = {k: v for k, v in results.get(name, {}).items() if k != "problems"}
        result["status"] = entry["status"]
        if section in ("parity", "figures"):
            doc.setdefault(section, {})[name] = result
        else:
            doc[section] = result
    doc["goals"] = goals(doc.get("figures", {}))
    counts: dict[str, int] = {}
    for entry in doc["steps"]:
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    doc["summary"] = counts | {
        "ok": all(
            s["status"] == "passed" or s.get("reason") == "not selected" for s in doc["steps"]
        )
    }
    (out / "bench.md").write_text(bench_markdown(doc))
    print(summary_text(doc), flush=True)


def device_line(doc: dict[str, Any]) -> str:
    env = doc.get("env", {})
    if doc["dry_run"]:
        return "Dry run on the CPU with tiny models: these are not GPU figures."
    gpu = env.get("gpu", {}).get("name", "unknown GPU")
    return (
        f"{gpu}, driver {env.get('driver', '?')}, PyTorch {env.get('torch', '?')} "
        f"(CUDA {env.get('torch_cuda', '?')}), {doc['started']}"
    )


def bench_markdown(doc: dict[str, Any]) -> str:
    lines = ["# kvserve GPU check: figures", "", device_line(doc), "", "## Goals", ""]
    lines += ["| goal | figure | target | met |", "| --- | --- | --- | --- |"]
    for goal in doc["goals"]:
        value = "not measured" if goal["value"] is None else f"{goal['value']:.2f}x"
        met = {True: "yes", False: "no", None: "n/a"}[goal["met"]]
        lines.append(f"| {goal['goal']} | {value} | {goal['target']} | {met} |")
    lines += ["", "## Parity", "", "| model | dtype | run | max err | mean err | clear positions "
              "| tokens off | preemptions | prefix hits | graph buckets |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for step, result in doc.get("parity", {}).items():
        for dtype, runs in result.get("dtypes", {}).items():
            for run, e in runs.items():
                if "max_error" not in e:
                    continue
                lines.append(
                    f"| {step.removeprefix('parity-')} | {dtype} | {run} | {e['max_error']:.3g} "
                    f"| {e['mean_error']:.3g} | {e['decisive_positions']}/{e['positions']} "
                    f"| {e['mismatched_tokens']} | {e['preemptions']} "
                    f"| {e.get('wave3_prefix_hit_tokens', 0)} | {e['graph_buckets']} |"
                )
    for name, result in doc.get("figures", {}).items():
        lines += ["", f"## {name} ({result['status']})", ""]
        lines += ["```text", *figure_output(doc, name), "```"]
    runs = doc.get("profile", {}).get("runs")
    if runs:
        lines += ["", "## Decode steps profiled (Qwen3-0.6B shape)", ""]
        lines += ["```text", *profile_decode.markdown(runs), "```"]
    return "\n".join(lines) + "\n"


def figure_output(doc: dict[str, Any], name: str) -> list[str]:
    """The bench's own printed lines (its tables), from the step's entry and log."""
    log = Path(doc["work"]) / "logs" / f"{name}.log"
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [
        line
        for line in text
        if not line.startswith(("{", " ", "}", "[", "]")) and "it/s]" not in line  # no tqdm
    ][-60:]


def summary_text(doc: dict[str, Any]) -> str:
    lines = [f"[gpu-check] {device_line(doc)}"]
    for entry in doc["steps"]:
        reason = f"  {entry['reason'][:120]}" if entry.get("reason") else ""
        lines.append(f"  {entry['name']:28} {entry['status']:8} {entry['seconds']:7.1f} s{reason}")
    for goal in doc["goals"]:
        value = "not measured" if goal["value"] is None else f"{goal['value']:.2f}x"
        lines.append(f"  goal: {goal['goal']}: {value} (target {goal['target']})")
    summary = {k: v for k, v in doc["summary"].items() if k != "ok"}
    verdict = "all passed" if doc["summary"]["ok"] else "NOT all passed"
    lines.append(
        f"[gpu-check] {verdict}: {summary}; {doc.get('elapsed_s')} s; {time.strftime('%H:%M:%S')}"
    )
    return "\n".join(lines)
