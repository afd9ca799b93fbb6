"""Shared benchmark plumbing: repetitions and medians, peak memory, tables, JSON, common flags."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import torch

from kvserve.core.percentile import percentile  # noqa: F401  # the benchmarks import it from here
from kvserve.cpu_isa import cpu_isa
from kvserve.kernels.huge_pages import huge_pages_wanted, transparent_huge_pages
from kvserve.trace.cli import add_trace_arg

Metrics = dict[str, float]


@dataclass
class PeakMemory:
    """Peak resident memory (bytes) seen by a sampling thread while a block ran."""

    peak_rss: int = 0


@contextmanager
def track_peak_rss(interval_s: float = 0.02) -> Iterator[PeakMemory]:
    """Sample this process's RSS in the background; ``peak_rss`` holds the maximum."""
    process = psutil.Process()
    result = PeakMemory(process.memory_info().rss)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            result.peak_rss = max(result.peak_rss, process.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        done.set()
        thread.join()
        result.peak_rss = max(result.peak_rss, process.memory_info().rss)


def median_metrics(
    run: Callable[[], Metrics], repetitions: int, warmup: Callable[[], Any] | None = None
) -> tuple[Metrics, list[Metrics]]:
    """Run ``warmup`` once, then ``run`` ``repetitions`` times; the median of each metric.

    Returns the medians and every repetition's metrics.
    """
    if warmup is not None:
        warmup()
    runs = [run() for _ in range(repetitions)]
    return median_of_runs(runs), runs


def median_of_runs(runs: list[Metrics]) -> Metrics:
    """The median of each metric over ``runs`` (at least one, all with the same keys)."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


@dataclass
class Table:
    """A plain-text table, printed with aligned columns."""

    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([_format(cell) for cell in cells])

    def render(self) -> str:
        widths = [
            max(len(str(c)) for c in col) for col in zip(self.columns, *self.rows, strict=False)
        ]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=True))]
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in self.rows
        ]
        return "\n".join(lines)


def _format(cell: object) -> str:
    if isinstance(cell, float):
        return f"{cell:,.1f}" if abs(cell) >= 10 else f"{cell:.3g}"
    return str(cell)


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


class CpuInfo(NamedTuple):
    """The CPU's model name and the matrix features that decide bf16 speed."""

    model: str
    avx512_bf16: bool
    amx: bool
    family_model: str = ""  # "family 25 model 1": the micro-architecture the name often hides

    def describe(self) -> str:
        def yes_no(flag: bool) -> str:
            return "yes" if flag else "no"

        return (
            f"CPU: {self.model}{f' ({self.family_model})' if self.family_model else ''}, "
            f"{psutil.cpu_count(logical=False)} physical cores; "
            f"AVX512_BF16: {yes_no(self.avx512_bf16)}, AMX: {yes_no(self.amx)}; "
            f"{cpu_isa().describe()}; PyTorch kernels: {torch.backends.cpu.get_cpu_capability()}; "
            f"weights on huge pages: {yes_no(huge_pages_wanted())} "
            f"(transparent huge pages: {transparent_huge_pages() or 'none'})"
        )


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU, from /proc/cpuinfo (Linux; elsewhere the model is all we know)."""
    model = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if key.strip() == "flags":
                    break  # the first processor's block is enough
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    family_model = (
        f"family {fields['cpu family']} model {fields['model']}"
        if "cpu family" in fields and "model" in fields
        else ""
    )
    return CpuInfo(
        fields.get("model name", model),
        "avx512_bf16" in flags,
        bool(flags & {"amx_tile", "amx_bf16"}),
        family_model,
    )


def machine_description() -> dict[str, Any]:
    """What the figures were measured on (with the GPU, where this process used one)."""
    cpu = cpu_info()
    description = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu.model,
        "cpu_family_model": cpu.family_model,
        "avx512_bf16": cpu.avx512_bf16,
        "amx": cpu.amx,
        "cpu_isa": cpu_isa().level,
        "cpu_isa_restricted": cpu_isa().restricted,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "transparent_huge_pages": transparent_huge_pages(),
        "weights_on_huge_pages": huge_pages_wanted(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_initialized():
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device())
        description["gpu"] = {
            "name": gpu.name,
            "memory_gib": round(gpu.total_memory / 1024**3, 1),
            "multiprocessors": gpu.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    return description


def write_json(path: str | Path, name: str, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` with the machine description, a timestamp and FlexAttention's
    compiles so far in this process."""
    from kvserve.attention.flex_compile import COMPILE_STATS
    from kvserve.kernels.tuning import describe_choice

    document = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_description(),
        "flex_compiles": vars(COMPILE_STATS),
        "kernel_tuning": describe_choice(),
        **payload,
    }
    Path(path).write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every benchmark takes: repetitions, JSON output, baselines, the step trace.

    The engine's ``--seed`` also seeds the workload (prompt texts and lengths).
    """
    parser.add_argument("--repetitions", type=int, default=3, help="timed runs per system (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--no-baselines", action="store_true", help="measure kvserve only (no baseline runs)"
    )
    add_trace_arg(parser)


def add_baselines_arg(
    parser: argparse.ArgumentParser, choices: Sequence[str], default: Sequence[str]
) -> None:
    """``--baselines NAME ...``: which baselines to run beside kvserve (``--no-baselines``: none)."""
    parser.add_argument(
        "--baselines",
        nargs="+",
        choices=tuple(choices),
        default=tuple(default),
        help=f"baselines to run beside kvserve (default: {' '.join(default) or 'none'})",
    )


def selected_baselines(args: argparse.Namespace) -> tuple[str, ...]:
    """The baselines this run measures: ``--baselines``, or none with ``--no-baselines``."""
    return () if args.no_baselines else tuple(args.baselines)
