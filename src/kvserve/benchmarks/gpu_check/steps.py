"""The check's steps, in the order they run: correctness first, then the figures.

Each runs in a child process (``driver.py``) under its budget. The whole run stops starting steps at ``--deadline-s`` (450 s by
default), so the budgets of the late steps are caps, not promises: a second
call with ``--only`` runs what the first did not reach.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from kvserve.benchmarks.gpu_check import figures, parity
from kvserve.benchmarks.gpu_check.context import Context, Step
from kvserve.benchmarks.gpu_check.models import SHAPES, build_model
from kvserve.benchmarks.gpu_check.prepare import REQUIRED_MODULES, WHEELS

# Tests skipped without a GPU are found by this reason, so new ones join the check.
CUDA_SKIP_REASON = 'reason="no CUDA device"'


def env(ctx: Context) -> dict[str, Any]:
    """The machine, the GPU and its driver, the packages; problems: no CUDA, missing modules."""
    import torch

    result: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": {},
        "missing_modules": {},
    }
    for name in ("transformers", "tokenizers", "safetensors", "triton", "numpy", *WHEELS):
        try:
            result["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            result["packages"][name] = None
    for module in REQUIRED_MODULES:
        if ctx.dry_run and module == "triton":  # PyTorch's CPU builds come without it
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:
            result["missing_modules"][module] = f"{type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 1024**3, 1),
            "multiprocessors": props.multi_processor_count,
        }
    if shutil.which("nvidia-smi"):
        fields = (
            "name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw"
        )
        query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
        print(smi.stdout, smi.stderr)
        values = [v.strip() for v in smi.stdout.splitlines()[0].split(",")] if smi.stdout else []
        result["nvidia_smi"] = dict(zip(fields.split(","), values, strict=False))
        result["driver"] = result["nvidia_smi"].get("driver_version")
    problems = []
    if not ctx.dry_run and not torch.cuda.is_available():
        problems.append("PyTorch sees no CUDA device")
    if result["missing_modules"]:
        problems.append(
            f"missing modules {', '.join(result['missing_modules'])}: carry .gpu-check "
            "(make gpu-wheels) with the call"
        )
    print(result)
    return result | {"problems": problems}


def ceilings(ctx: Context) -> dict[str, Any]:
    """Copy bandwidth and square matrix-product rates of the device, measured here."""
    import torch

    from kvserve.benchmarks.offline.roofline import matmul_flops, memory_bandwidth

    device = torch.device(ctx.device)
    size = 8192 if device.type == "cuda" else 512
    result = {
        "device": str(device),
        "copy_bytes_per_s": memory_bandwidth(None if device.type == "cuda" else 2**25, device),
        "bf16_matmul_flops": matmul_flops(size, size, size, torch.bfloat16, device),
        "fp32_matmul_flops": matmul_flops(size, size, size, torch.float32, device),
        "matmul_size": size,
    }
    print(result)
    return result


def cuda_test_files(repo: Path) -> list[str]:
    """Test files that skip without a CUDA device."""
    files = sorted((repo / "tests").rglob("test_*.py"))
    return [str(p.relative_to(repo)) for p in files if CUDA_SKIP_REASON in p.read_text()]


def tests(ctx: Context) -> dict[str, Any]:
    """The CUDA tests under pytest; on the GPU none may fail or skip."""
    import pytest

    files = cuda_test_files(ctx.repo)
    junit = ctx.work / "junit.xml"
    args = ["-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    start = time.perf_counter()
    exit_code = int(pytest.main(args))
    counts = junit_counts(junit.read_text()) if junit.exists() else {}
    result: dict[str, Any] = {
        "files": files,
        "exit_code": exit_code,
        "seconds": round(time.perf_counter() - start, 1),
        **counts,
    }
    problems = []
    if not files:
        problems.append(f"no test file has {CUDA_SKIP_REASON}")
    if exit_code != 0:
        problems.append(f"pytest exited with {exit_code}")
    if counts.get("failures") or counts.get("errors"):
        problems.append(f"{counts['failures']} failed, {counts['errors']} errors")
    if not ctx.dry_run and counts.get("skipped"):
        problems.append(f"{counts['skipped']} CUDA tests skipped on the GPU machine")
    return result | {"problems": problems}


def junit_counts(xml: str) -> dict[str, int]:
    """tests, failures, errors, skipped of pytest's JUnit XML (its first testsuite)."""
    match = re.search(r"<testsuite\b([^>]*)>", xml)
    attrs = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) if match else {}
    return {key: int(attrs.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def models(ctx: Context) -> dict[str, Any]:
    """The random-weight models the selected steps need (all, by default), built on the device."""
    built = {}
    for name in ctx.models or SHAPES:
        folder = ctx.work / "models" / name
        if folder.exists():
            shutil.rmtree(folder)
        built[name] = build_model(name, folder, ctx.tokenizer, ctx.device, tiny=ctx.dry_run)
        print(name, built[name])
    return {"models": built}


def parity_step(name: str) -> Step:
    def run(ctx: Context) -> dict[str, Any]:
        return parity.check_model(ctx, name)

    return Step(f"parity-{name}", "parity", run, parity.BUDGETS_S[name], ("models",), (name,))


def bench_step(name: str, budget_s: float) -> Step:
    def run(ctx: Context) -> dict[str, Any]:
        return figures.run_bench(ctx, name)

    return Step(name, "figures", run, budget_s, ("models",), models=(figures.BENCHES[name][1],))


def profile(ctx: Context) -> dict[str, Any]:
    """The kernels of a few decode steps at 1 and 256 sequences (1 and 4 in a dry run),
    with KV blocks of 16 tokens, and of 64 at the larger size."""
    from kvserve.benchmarks.gpu_check.profile_decode import markdown, profile_decode

    most = 4 if ctx.dry_run else 256
    runs = ((1, 16), (most, 16), (most, 64))
    result = profile_decode(ctx.model_path(PROFILED_MODEL), ctx.device, runs)
    print("\n".join(markdown(result)))
    return {"runs": result}


PROFILED_MODEL = "qwen3-0.6b"

STEPS: list[Step] = [
    Step("env", "env", env, 60),
    Step("ceilings", "ceilings", ceilings, 60),
    Step("tests", "tests", tests, 180, pytest_log=True),
    Step("models", "models", models, 120),
    *(parity_step(name) for name in SHAPES),
    bench_step("throughput-qwen3-0.6b", 240),
    bench_step("latency-qwen3-0.6b-graphs", 90),
    bench_step("latency-qwen3-0.6b-eager", 90),
    bench_step("sweep-qwen3-0.6b", 180),
    bench_step("throughput-smollm2-135m", 180),
    Step("profile-qwen3-0.6b", "profile", profile, 120, ("models",), (PROFILED_MODEL,)),
]
