"""The figures: ``kvserve bench`` runs on the random-weight models, and what they show.

Every figure comes from the existing benchmarks, run through their command
line in the step's process, their JSON read back:

- ``throughput``: the nano-vllm workload (256 requests, prompt and output
  lengths uniform in 100-1024, ``ignore_eos``) against transformers' static
  batching on the same GPU. Static batching runs each batch for its longest
  output (about 1,000 steps), so the baseline runs the first 64 requests as
  one batch (``--baseline-requests``): its rate over a sample of the same
  workload, with a batch twice the benchmark's default;
- ``latency``: batch-1 ms per output token with CUDA graphs and eagerly
  (``--enforce-eager``);
- ``sweep``: decode-step time at 1, 16, 64 and 256 sequences beside its floor
  (weight and K/V bytes over the measured copy bandwidth) and its host time.

Each JSON carries FlexAttention's compile count and time. The dry run runs
the same commands on tiny models and sizes.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.benchmarks.gpu_check.context import Context

# step name: (benchmark, model, engine flags beyond the benchmark's own)
BENCHES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "throughput-qwen3-0.6b": ("throughput", "qwen3-0.6b", ()),
    "latency-qwen3-0.6b-graphs": ("latency", "qwen3-0.6b", ()),
    "latency-qwen3-0.6b-eager": ("latency", "qwen3-0.6b", ("--enforce-eager", "--no-baselines")),
    "sweep-qwen3-0.6b": ("sweep", "qwen3-0.6b", ()),
    "throughput-smollm2-135m": ("throughput", "smollm2-135m", ()),
}
# The device's sizes, then the dry run's.
WORKLOADS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "throughput": (
        (
            "--num-requests", "256", "--input-len", "100", "1024", "--output-len", "100", "1024",
            "--baselines", "static", "--hf-batch-size", "64", "--baseline-requests", "64",
            "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
            "--kv-cache-memory-bytes", "32GiB", "--max-model-len", "2048", "--repetitions", "1",
        ),
        (
            "--num-requests", "4", "--input-len", "8", "16", "--output-len", "3", "6",
            "--baselines", "static", "--hf-batch-size", "2", "--baseline-requests", "2",
            "--repetitions", "1",
        ),
    ),
    "latency": (
        ("--prompt-lens", "128", "--output-len", "128", "--repetitions", "3", "--max-model-len", "2048"),
        ("--prompt-lens", "16", "--output-len", "4", "--repetitions", "1"),
    ),
    "sweep": (
        (
            "--concurrency", "1", "16", "64", "256", "--input-len", "128", "512", "--output-len",
            "64", "--repetitions", "1", "--max-num-batched-tokens", "8192", "--num-blocks",
            "12288", "--max-model-len", "2048",
        ),
        ("--concurrency", "1", "2", "--input-len", "8", "16", "--output-len", "4",
         "--repetitions", "1"),
    ),
}  # fmt: skip


def bench_argv(ctx: Context, name: str) -> list[str]:
    """The ``kvserve`` command line of bench step ``name``."""
    benchmark, model, flags = BENCHES[name]
    workload = WORKLOADS[benchmark][1 if ctx.dry_run else 0]
    # One thread in the dry run: OpenMP's threads stall on a small, shared CPU.
    workload += ("--num-threads", "1") if ctx.dry_run else ()
    json_path = ctx.work / "bench" / f"{name}.json"
    return [
        "bench", benchmark, "--model", ctx.model_path(model), "--device", ctx.device,
        *workload, *flags, "--json", str(json_path),
    ]  # fmt: skip


def run_bench(ctx: Context, name: str) -> dict[str, Any]:
    """Run bench step ``name`` here and summarise its JSON; problems: a failed run."""
    from kvserve.cli import main

    argv = bench_argv(ctx, name)
    json_path = ctx.work / "bench" / f"{name}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.unlink(missing_ok=True)
    print("kvserve " + " ".join(argv), flush=True)
    exit_code = main(argv)
    result: dict[str, Any] = {"argv": ["kvserve", *argv], "exit_code": exit_code}
    if exit_code != 0 or not json_path.exists():
        return result | {"problems": [f"kvserve bench exited with {exit_code}"]}
    report = json.loads(json_path.read_text())
    summary = SUMMARIES[BENCHES[name][0]](report)
    result |= summary | {
        "flex_compiles": report.get("flex_compiles"),
        "gpu": report.get("machine", {}).get("gpu"),
    }
    print(json.dumps(result, indent=1), flush=True)
    return result


def throughput_summary(report: dict[str, Any]) -> dict[str, Any]:
    results = report["results"]
    ours = results["kvserve"]["output_tok_per_s"]
    theirs = results.get("hf_static", {}).get("output_tok_per_s")
    return {
        "kvserve_output_tok_per_s": ours,
        "kvserve_wall_s": results["kvserve"]["wall_s"],
        "hf_static_output_tok_per_s": theirs,
        "speedup_vs_hf_static": ours / theirs if theirs else None,
        "notes": report.get("notes", []),
    }


def latency_summary(report: dict[str, Any]) -> dict[str, Any]:
    kvserve = report["results"]["kvserve"]
    prompt_len = min(kvserve, key=int)
    hf = report["results"].get("hf_generate", {}).get(prompt_len)
    return {
        "prompt_len": int(prompt_len),
        "ms_per_token": kvserve[prompt_len]["ms_per_token"],
        "ttft_ms": 1000 * kvserve[prompt_len]["ttft_s"],
        "hf_generate_ms_per_token": hf["ms_per_token"] if hf else None,
    }


def sweep_summary(report: dict[str, Any]) -> dict[str, Any]:
    points = {}
    for concurrency, metrics in report["results"].items():
        floor = metrics.get("decode_step_floor_ms") or 0.0
        points[concurrency] = {
            "output_tok_per_s": metrics["output_tok_per_s"],
            "decode_step_ms": metrics["decode_step_ms"],
            "decode_step_host_ms": metrics["decode_step_host_ms"],
            "decode_step_floor_ms": floor,
            "step_over_floor": metrics["decode_step_ms"] / floor if floor else None,
        }
    return {"points": points, "memory_bytes_per_s": report["roofline"]["memory_bytes_per_s"]}


SUMMARIES = {"throughput": throughput_summary, "latency": latency_summary, "sweep": sweep_summary}
