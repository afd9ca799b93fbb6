"""llama.cpp's own benchmark tools, run on the same GGUF file kvserve loads.

``llama-bench`` (batch-1 prompt processing and decode at a given context
depth) and ``llama-batched-bench`` (decode of many sequences at once, its
S_TG) are llama.cpp's reference figures; measuring llama.cpp through its Python
binding adds per-token Python overhead that flatters kvserve. The tools come
from :mod:`kvserve.benchmarks.baselines.llamacpp_build`'s build for the instruction set
this process runs (``KVSERVE_CPU_ISA``), so a ``--cpu-isa avx2`` benchmark
compares against llama.cpp built for AVX2. By default they run the very GGUF
kvserve loaded, quantized types and all (``--llamacpp-weights source``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import NamedTuple

from kvserve.benchmarks.baselines.llamacpp_build import SDIST_VERSION, tools_dir
from kvserve.benchmarks.baselines.llamacpp_weights import (
    WEIGHT_ORIGINS,
    LlamaCppWeights,
    llamacpp_model_file,
)
from kvserve.cpu_isa import cpu_flags, cpu_isa, restrict
from kvserve.errors import InvalidParameterError
from kvserve.loader import resolve_model


class ToolBuild(NamedTuple):
    """Which build of llama.cpp's tools runs: its folder and the level it was built for."""

    folder: Path
    level: str

    def tool(self, name: str) -> Path:
        return self.folder / name

    def describe(self) -> str:
        return f"llama.cpp {SDIST_VERSION} tools, {self.level} build ({self.folder})"


def tool_build(param: str = "baselines") -> ToolBuild:
    """The build for this process's instruction set; raises naming ``param`` when it is missing.

    A native run on a CPU with nothing above AVX2 may use the AVX2 build: it
    enables every vector extension such a CPU has.
    """
    level = cpu_isa().level
    candidates = [level]
    if level == "native" and not restrict("avx2", cpu_flags()).restricted:
        candidates.append("avx2")
    for candidate in candidates:
        if (tools_dir(candidate) / "llama-bench").exists():
            return ToolBuild(tools_dir(candidate), candidate)
    raise InvalidParameterError(
        param,
        f"llama.cpp's tools are not built for {level} (looked in {tools_dir(level)}); "
        f"build them with `make bench-deps` or "
        f"`python -m kvserve.benchmarks.baselines.llamacpp_build {level}`",
    )


class ToolRun(NamedTuple):
    """A tool baseline ready to run: the build, the GGUF it loads and where that file came from."""

    build: ToolBuild
    model_file: Path
    weights: LlamaCppWeights

    def describe(self, tool: str) -> str:
        return (
            f"{tool}: {self.build.describe()} runs {self.model_file} "
            f"({WEIGHT_ORIGINS[self.weights]})"
        )

    def as_json(self) -> dict[str, str]:
        return {
            "build": str(self.build.folder),
            "level": self.build.level,
            "model_file": str(self.model_file),
            "weights": self.weights,
        }


def prepare_tool_run(model: str, weights: LlamaCppWeights) -> ToolRun:
    """The build and the file a tool baseline runs, checked before anything is measured.

    Raises InvalidParameterError when the tools are not built and ModelLoadError
    when ``model`` is not a GGUF (llama.cpp reads nothing else). With ``bf16``
    the BF16 copy is written now, if the cache does not hold it yet.
    """
    build = tool_build()
    return ToolRun(build, llamacpp_model_file(resolve_model(model), weights), weights)


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{Path(command[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    return result.stdout


class BenchRow(NamedTuple):
    """One ``llama-bench`` test: prompt tokens, generated tokens, context depth, median tok/s."""

    n_prompt: int
    n_gen: int
    n_depth: int
    tokens_per_s: float


def llama_bench(
    build: ToolBuild,
    model: Path,
    threads: int,
    repetitions: int,
    n_prompt: int = 0,
    n_gen: int = 0,
    depths: tuple[int, ...] = (0,),
) -> list[BenchRow]:
    """``llama-bench`` on ``model``: the median of each test's repetitions (flash attention on)."""
    output = _run(
        [
            str(build.tool("llama-bench")),
            "-m", str(model),
            "-t", str(threads),
            "-r", str(repetitions),
            "-p", str(n_prompt),
            "-n", str(n_gen),
            "-d", ",".join(map(str, depths)),
            "-fa", "1",
            "-o", "json",
        ]
    )  # fmt: skip
    return [
        BenchRow(
            int(test["n_prompt"]),
            int(test["n_gen"]),
            int(test.get("n_depth", 0)),
            statistics.median(test["samples_ts"]),
        )
        for test in json.loads(output)
    ]


class BatchedRow(NamedTuple):
    """One ``llama-batched-bench`` row: prompt and generated tokens a sequence, sequences, rates."""

    prompt_tokens: int
    generated_tokens: int
    sequences: int
    prompt_tokens_per_s: float  # S_PP
    decode_tokens_per_s: float  # S_TG: generated tokens of all sequences over decode time


def batched_bench(
    build: ToolBuild,
    model: Path,
    threads: int,
    prompt_tokens: int,
    generated_tokens: int,
    sequences: tuple[int, ...],
) -> list[BatchedRow]:
    """``llama-batched-bench`` on ``model`` (each sequence its own prompt, flash attention on)."""
    context = max(sequences) * (prompt_tokens + generated_tokens) + 256
    output = _run(
        [
            str(build.tool("llama-batched-bench")),
            "-m", str(model),
            "-t", str(threads),
            "-c", str(context),
            "-b", "2048",
            "-ub", "512",
            "-npp", str(prompt_tokens),
            "-ntg", str(generated_tokens),
            "-npl", ",".join(map(str, sequences)),
            "-fa", "on",
            "--output-format", "jsonl",
        ]
    )  # fmt: skip
    rows = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            record = json.loads(line)
            rows.append(
                BatchedRow(
                    int(record["pp"]),
                    int(record["tg"]),
                    int(record["pl"]),
                    float(record["speed_pp"]),
                    float(record["speed_tg"]),
                )
            )
    return rows
