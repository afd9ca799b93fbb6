"""Run the check's steps, each in a child process under a time budget, and record everything.

The parent imports the heavy modules once (torch, transformers, kvserve) and
forks a child per step, which starts with them loaded; it never touches CUDA
itself, so each child initialises CUDA afresh. (Should an import have
initialised CUDA anyway, or with ``--executor exec``, each step runs in a new
interpreter instead.) A child that raises, fails its own checks or outlives
its budget is recorded so, its process group is killed, and the next step
runs; steps that need one that did not pass are skipped. After every step
``results.json`` is rewritten, so a run cut short keeps what it found
(``record.py`` says which files a run writes).

``--resume`` runs only what the last run in the same work folder left without
a verdict (skipped for lack of time, timed out) and keeps the rest, models
included: on the GPU machine, a second call right after the first (while the
machine is still warm) finishes the check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kvserve.benchmarks.gpu_check.context import Context, Step
from kvserve.benchmarks.gpu_check.record import Record, previous_run

# A step is not started with less time than this left before the deadline.
MIN_START_S = {True: 5.0, False: 20.0}  # keyed by dry_run
DEFAULT_DEADLINE_S = {True: 600.0, False: 450.0}
PRELOAD = (
    "torch",
    "transformers",
    "pytest",
    "kvserve.cli",
    "kvserve.llm",
    "kvserve.benchmarks.gpu_check.steps",
)
TRANSFORMERS_CLASSES = (
    "AutoConfig",
    "AutoTokenizer",
    "PreTrainedTokenizerFast",
    "AutoModelForCausalLM",
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.gpu_check")
    parser.add_argument("--out", type=Path, required=True, help="where the result files go")
    parser.add_argument("--work", type=Path, help="scratch: models, bench JSON (default: OUT/../)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, with tiny models")
    parser.add_argument("--tokenizer", type=Path, default=Path(".gpu-check/tokenizer"))
    parser.add_argument("--deadline-s", type=float, help="stop starting steps after this long")
    parser.add_argument("--only", default="", help="comma-separated steps (and what they need)")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out")
    parser.add_argument(
        "--resume", action="store_true", help="keep the last run's verdicts (same --work)"
    )
    parser.add_argument("--break-step", help="make this step fail on purpose (tests the driver)")
    parser.add_argument("--executor", choices=("fork", "exec"), default="fork")
    parser.add_argument("--list", action="store_true", help="list the steps and exit")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # exec executor: run one step here
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvserve.benchmarks.gpu_check.steps import STEPS

    if args.list:
        for step in STEPS:
            print(f"{step.name:28} {step.section:9} budget {step.budget_s:.0f} s")
        return 0
    out = args.out.resolve()
    ctx = Context(
        repo=Path.cwd(),
        out=out,
        work=(args.work or out.parent / f"{out.name}-work").resolve(),
        dry_run=args.dry_run,
        tokenizer=args.tokenizer.resolve(),
        break_step=args.break_step,
    )
    chosen = selected(STEPS, args.only, args.skip)
    ctx.models = tuple(sorted({m for s in STEPS if s.name in chosen for m in s.models}))
    if args.step is not None:  # a child of the exec executor
        ctx.results = json.loads((ctx.work / "results.json").read_text())["step_results"]
        return run_step_here(next(s for s in STEPS if s.name == args.step), ctx)
    out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    previous = previous_run(ctx.work) if args.resume else {}
    deadline_s = args.deadline_s or DEFAULT_DEADLINE_S[ctx.dry_run]
    record = Record(ctx, deadline_s)
    record.doc["preload"] = preload() if args.executor == "fork" else {}
    if record.doc["preload"].get("cuda_initialized"):
        args.executor = "exec"
    record.doc["executor"] = args.executor
    for step in STEPS:
        entry: dict[str, Any] = {
            "name": step.name,
            "section": step.section,
            "status": "skipped",
            "seconds": 0.0,
        }
        missing = [n for n in step.needs if record.status(n) != "passed"]
        remaining = record.start + deadline_s - time.time()
        kept = previous.get(step.name) if step.name in chosen else None
        if kept is not None and not (step.name == "models" and lacks_models(kept[1], ctx)):
            entry, result = kept[0] | {"resumed": True}, kept[1]
            if result is not None:
                ctx.results[step.name] = result
        elif step.name not in chosen:
            entry["reason"] = "not selected"
        elif missing:
            entry["reason"] = f"needs {', '.join(missing)}, which did not pass"
        elif remaining < MIN_START_S[ctx.dry_run]:
            entry["reason"] = "out of time (--deadline-s)"
        else:
            entry.update(execute(step, ctx, args, min(step.budget_s, remaining)))
            if "result" in entry:
                ctx.results[step.name] = entry.pop("result")
        record.add(step, entry)
    record.finish()
    return 0 if record.ok() else 1


def lacks_models(result: dict[str, Any] | None, ctx: Context) -> bool:
    """Whether the last run's models step left out a model this run needs (or its folder)."""
    built = (result or {}).get("models", {})
    return any(name not in built or not Path(built[name]["path"]).is_dir() for name in ctx.models)


def selected(steps: list[Step], only: str, skip: str) -> set[str]:
    """Names of the steps to run: ``only`` (and, recursively, what they need) less ``skip``."""
    by_name = {step.name: step for step in steps}
    names = {n for n in only.split(",") if n} or set(by_name)
    unknown = names - set(by_name) | {n for n in skip.split(",") if n} - set(by_name)
    if unknown:
        raise SystemExit(f"unknown steps: {', '.join(sorted(unknown))}; see --list")
    pending = list(names)
    while pending:
        for need in by_name[pending.pop()].needs:
            if need not in names:
                names.add(need)
                pending.append(need)
    return names - {n for n in skip.split(",") if n}


def preload() -> dict[str, Any]:
    """Import what the steps use, so that forked children start with it loaded."""
    start = time.perf_counter()
    errors = {}
    for module in PRELOAD:
        try:
            __import__(module)
        except Exception as exc:  # the step that needs it reports it; env lists it
            errors[module] = f"{type(exc).__name__}: {exc}"
    try:
        # What transformers loads lazily (modelling and tokenizer code), once for every child.
        import transformers

        for name in TRANSFORMERS_CLASSES:
            getattr(transformers, name)
    except Exception as exc:
        errors["transformers classes"] = f"{type(exc).__name__}: {exc}"
    torch = sys.modules.get("torch")
    initialized = bool(torch is not None and torch.cuda.is_initialized())
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "errors": errors,
        "cuda_initialized": initialized,
    }


def execute(step: Step, ctx: Context, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """Run ``step`` in a child (its own process group) for at most ``timeout`` seconds."""
    log_path = ctx.work / "logs" / f"{step.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    result_path = ctx.work / "logs" / f"{step.name}.json"
    result_path.unlink(missing_ok=True)
    start = time.perf_counter()
    cpu_start = _children_cpu_s()
    print(f"[gpu-check] {step.name}: running (at most {timeout:.0f} s)", flush=True)
    if args.executor == "fork":
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.setpgid(0, 0)
                code = run_step_here(step, ctx)
            finally:
                os._exit(code)
    else:
        command = [sys.executable, "-m", "kvserve.benchmarks.gpu_check", "--step", step.name]
        command += [
            "--out",
            str(ctx.out),
            "--work",
            str(ctx.work),
            "--tokenizer",
            str(ctx.tokenizer),
        ]
        command += ["--only", args.only, "--skip", args.skip, "--break-step", args.break_step or ""]
        command += ["--dry-run"] * ctx.dry_run
        pid = subprocess.Popen(command, start_new_session=True).pid
    timed_out = not wait_for(pid, timeout)
    # Whatever the child left behind (compile workers, ...) goes with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if timed_out:
        os.waitpid(pid, 0)
    entry: dict[str, Any] = {
        "seconds": round(time.perf_counter() - start, 1),
        "cpu_s": round(_children_cpu_s() - cpu_start, 1),  # the step process's, once reaped
    }
    if timed_out:
        entry.update(status="timeout", reason=f"still running after {timeout:.0f} s")
    elif result_path.exists():
        entry.update(json.loads(result_path.read_text()))
    else:
        entry.update(status="error", reason="the step's process died without a result")
    return entry


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for(pid: int, timeout: float) -> bool:
    """Wait for child ``pid`` to exit; False if it is still running after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        time.sleep(0.1)
    return False


def run_step_here(step: Step, ctx: Context) -> int:
    """The child's side: run the step with its output in its log, and save its result."""
    logs = ctx.work / "logs"
    log = os.open(logs / f"{step.name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    outcome: dict[str, Any]
    try:
        if ctx.break_step == step.name:
            raise RuntimeError("broken on purpose (--break-step)")
        result = step.run(ctx)
        problems = result.get("problems") or []
        outcome = {"status": "failed" if problems else "passed", "result": result}
        if problems:
            outcome["reason"] = "; ".join(problems)[:2000]
    except BaseException as exc:
        traceback.print_exc()
        outcome = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = logs / f"{step.name}.json.tmp"
    tmp.write_text(json.dumps(outcome, indent=1, default=str))
    tmp.rename(logs / f"{step.name}.json")
    return 0
