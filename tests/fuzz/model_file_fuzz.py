"""Fuzz kvserve's model loading with damaged model files.

Every case takes a tiny honest model (:mod:`fuzz.model_file_bases`), damages
it (:mod:`fuzz.gguf_mutations`, :mod:`fuzz.hf_mutations`) and loads it the way
the engine does: ``resolve_model`` → ``load_arch_config`` → ``load_tokenizer``
→ ``build_model`` → ``load_weights(CachedWeights(...))``. A case passes when
it loads or raises ``ModelLoadError``; any other exception is a crash. Cases
run in a worker process whose address space is capped at its start-up size
plus ``--memory-bound-mib``, so an allocation past the bound fails (a crash:
MemoryError, or PyTorch's "can't allocate memory") instead of slowing the
machine, and each case has a timeout: the parent kills and restarts a worker
that hangs or dies.

    PYTHONPATH=tests python -m fuzz.model_file_fuzz --cases 10000   # make fuzz
    PYTHONPATH=tests python -m fuzz.model_file_fuzz --replay 1234   # one case, with its traceback

The worker side (building and running a case) is :mod:`fuzz.model_file_cases`.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.model_file_cases import CaseMaker, load_model_files, worker_main

DEFAULT_MEMORY_BOUND_MIB = 1024
_WORKER_START_TIMEOUT_S = 300.0


class Worker:
    """A worker process; ``run`` returns None when the case hung or the worker died."""

    def __init__(self, seed: int, memory_bound_mib: int, log_path: Path) -> None:
        tests_dir = Path(__file__).resolve().parents[1]
        import kvserve

        src_dir = Path(kvserve.__file__).resolve().parents[1]
        env = dict(os.environ, KVSERVE_WEIGHT_CACHE="0", TRANSFORMERS_VERBOSITY="error")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(tests_dir), str(src_dir), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.log = log_path.open("ab")
        command = [sys.executable, "-m", "fuzz.model_file_fuzz", "--worker", "--seed", str(seed)]
        command += ["--memory-bound-mib", str(memory_bound_mib)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env
        )
        ready = self._read_line(_WORKER_START_TIMEOUT_S) or ""
        if not ready.startswith("ready "):
            self.stop()
            tail = log_path.read_bytes()[-3000:].decode(errors="replace")
            raise RuntimeError(f"the fuzz worker did not start:\n{tail}")
        self.start_rss_mib = float(ready.split()[1])

    def run(self, index: int, timeout: float) -> dict[str, Any] | None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(f"{index}\n".encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        line = self._read_line(timeout)
        return None if line is None else json.loads(line)

    def _read_line(self, timeout: float) -> str | None:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        return line.decode().strip() if line else None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


@dataclass
class Summary:
    """What a run found; ``failures`` are the cases that neither loaded nor raised ModelLoadError."""

    seed: int
    outcomes: Counter[str] = field(default_factory=Counter)
    by_base: Counter[tuple[str, str]] = field(default_factory=Counter)
    error_fields: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    start_rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    slowest_case_s: float = 0.0
    num_fields_shown: int = 15

    def add(self, result: dict[str, Any]) -> None:
        outcome = result["outcome"]
        self.peak_rss_mib = max(self.peak_rss_mib, result.get("peak_rss_mib", 0.0))
        self.slowest_case_s = max(self.slowest_case_s, result.get("seconds", 0.0))
        self.outcomes[outcome] += 1
        self.by_base[(result.get("base", "?"), outcome)] += 1
        if outcome == "ModelLoadError":
            self.error_fields[_field_kind(result["detail"])] += 1
        elif outcome != "ok":
            self.failures.append(result)

    def format(self) -> str:
        total = sum(self.outcomes.values())
        lines = [
            f"model-file fuzz: {total} cases, seed {self.seed}, {self.seconds:.1f} s; slowest "
            f"case {1000 * self.slowest_case_s:.0f} ms; worker RSS {self.start_rss_mib:.0f} MiB after "
            f"start-up, {self.peak_rss_mib:.0f} MiB at most"
        ]
        for outcome in ("ok", "ModelLoadError", "crash", "hang", "died", "harness"):
            lines.append(f"  {outcome:<15} {self.outcomes[outcome]:>7}")
        bases = sorted({base for base, _ in self.by_base})
        lines.append("by base model (ok / ModelLoadError / other):")
        for base in bases:
            ok, error = self.by_base[(base, "ok")], self.by_base[(base, "ModelLoadError")]
            other = sum(n for (b, o), n in self.by_base.items() if b == base) - ok - error
            lines.append(f"  {base:<18} {ok:>6} / {error:>6} / {other}")
        lines.append("ModelLoadError by field (most common):")
        for name, count in self.error_fields.most_common(self.num_fields_shown):
            lines.append(f"  {name:<40} {count:>6}")
        for failure in self.failures[:20]:
            replay = (
                f"python -m fuzz.model_file_fuzz --seed {self.seed} --replay {failure['index']}"
            )
            lines.append(
                f"FAILED case {failure['index']} (replay: {replay}): {json.dumps(failure)}"
            )
        return "\n".join(lines)


def _field_kind(field_name: str) -> str:
    # Group per-layer tensor names (blk.7.attn_q.weight → blk.N.attn_q.weight).
    parts = ["N" if part.isdigit() else part for part in field_name.split(".")]
    return ".".join(parts)


def run_cases(
    count: int,
    seed: int,
    timeout: float = 30.0,
    memory_bound_mib: int = DEFAULT_MEMORY_BOUND_MIB,
    start: int = 0,
    progress: bool = False,
) -> Summary:
    """Run cases ``start .. start + count - 1`` in a worker process; see the module docstring."""
    summary = Summary(seed)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvserve-fuzz-log-") as log_dir:
        log_path = Path(log_dir) / "worker.log"
        worker = Worker(seed, memory_bound_mib, log_path)
        summary.start_rss_mib = worker.start_rss_mib
        try:
            for index in range(start, start + count):
                result = worker.run(index, timeout)
                if result is None:
                    outcome = "hang" if worker.process.poll() is None else "died"
                    if outcome == "hang":
                        worker.process.send_signal(signal.SIGUSR1)
                        time.sleep(1.0)
                    worker.stop()
                    tail = log_path.read_bytes()[-2000:].decode(errors="replace")
                    result = {"index": index, "outcome": outcome, "detail": tail}
                    worker = Worker(seed, memory_bound_mib, log_path)
                summary.add(result)
                if progress and (index - start + 1) % 1000 == 0:
                    print(f"  {index - start + 1} cases, {dict(summary.outcomes)}", flush=True)
        finally:
            worker.stop()
    summary.seconds = time.perf_counter() - began
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="index of the first case")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    parser.add_argument("--memory-bound-mib", type=int, default=DEFAULT_MEMORY_BOUND_MIB)
    parser.add_argument("--replay", type=int, help="run one case here and show its traceback")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.seed, args.memory_bound_mib)  # serves run_cases' Worker
        return 0
    if args.replay is not None:
        os.environ["KVSERVE_WEIGHT_CACHE"] = "0"
        with tempfile.TemporaryDirectory(prefix="kvserve-fuzz-") as work_dir:
            maker = CaseMaker(args.seed, Path(work_dir))
            base, mutation, path = maker.make(args.replay)
            print(f"case {args.replay}: {base}, {mutation}")
            load_model_files(path)
            print("loaded")
        return 0
    summary = run_cases(
        args.cases, args.seed, args.timeout, args.memory_bound_mib, args.start, progress=True
    )
    print(summary.format())
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
