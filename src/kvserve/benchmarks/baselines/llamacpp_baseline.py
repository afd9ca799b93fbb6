"""llama.cpp through llama-cpp-python, in a process of its own: what CPU users run instead.

- Single stream (``kvserve bench latency``): the high-level ``Llama`` API,
  greedy ``generate()``; it never stops at EOS by itself, and the benchmark
  takes exactly the tokens it asked for. TTFT and ms/token are measured as for
  kvserve: a one-token run from a cold KV cache, then a full run whose decode
  time (last token minus first) is divided by the tokens after the first.
- Batched decode (``throughput``, ``sweep``): the low-level C API, in
  :mod:`kvserve.benchmarks.baselines.llamacpp_batched`.

Each benchmark measures llama.cpp in a fresh process (:func:`in_own_process`),
after kvserve is done. Both use as many threads as kvserve (the physical
cores) and flash attention,
which is what llama.cpp's own "auto" setting picks on a CPU. The model file is
the source GGUF as stored (the default) or a BF16 copy of it
(:mod:`kvserve.benchmarks.baselines.llamacpp_weights`).

llama-cpp-python is an optional extra (``pip install -e '.[bench]'``, or
``make bench-deps``): nothing imports it unless a benchmark asks for the
baseline, and asking without it installed is an error, raised before anything
is measured, that says how to install it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from kvserve.benchmarks.baselines.llamacpp_weights import (
    WEIGHT_CHOICES,
    WEIGHT_ORIGINS,
    LlamaCppWeights,
    llamacpp_model_file,
)
from kvserve.benchmarks.common import Metrics
from kvserve.errors import InvalidParameterError
from kvserve.loader import resolve_model
from kvserve.worker.model_runner import physical_core_count

LLAMACPP = "llamacpp"  # the name of the baseline in --baselines and in the results
INSTALL_HINT = "make bench-deps (or: pip install -e '.[bench]')"

_T = TypeVar("_T")


def in_own_process(function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)`` in a freshly spawned Python process; its result comes back here.

    llama.cpp brings its own OpenMP runtime. In a process where PyTorch's has
    run (kvserve was measured first), the two runtimes' workers compete for the
    cores: llama.cpp's batched decode steps took 97 ms instead of 68-84 and its
    prompt processing three times as long. ``function`` and ``args`` must pickle.
    """
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, quiet; raises InvalidParameterError when it is not installed.

    Typed ``Any``: the extra is optional, and its ctypes signatures are not
    what this code should be checked against.
    """
    try:
        llama_cpp = importlib.import_module("llama_cpp")
    except (ImportError, OSError) as exc:
        raise InvalidParameterError(
            "baselines",
            f"{LLAMACPP} needs llama-cpp-python, which is not installed or does not load "
            f"({type(exc).__name__}: {exc}); install it with: {INSTALL_HINT}",
        ) from exc
    # llama-cpp-python routes llama.cpp's log through this logger; keep errors only.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


def add_llamacpp_args(parser: argparse.ArgumentParser) -> None:
    """``--llamacpp-weights``: which GGUF the llama.cpp baselines load.

    ``source`` by default: kvserve runs a quantized GGUF as stored, so llama.cpp
    is measured on the very file kvserve loaded. ``bf16`` stays for the row that
    compares the same arithmetic (both systems on bf16 weights).
    """
    parser.add_argument(
        "--llamacpp-weights",
        choices=WEIGHT_CHOICES,
        default="source",
        help="llama.cpp baselines: the model's own GGUF as stored, the file kvserve loads "
        "(source, the default), or a BF16 GGUF written from its weights (bf16)",
    )


@dataclass(frozen=True)
class LlamaCppSetup:
    """What the llama.cpp baseline runs: which file, how many threads, which build."""

    model_file: Path
    weights: LlamaCppWeights
    threads: int
    version: str
    system_info: str

    def describe(self) -> str:
        origin = WEIGHT_ORIGINS[self.weights]
        return (
            f"llama.cpp (llama-cpp-python {self.version}) runs {self.model_file.name} ({origin}), "
            f"{self.threads} threads, flash attention on\n"
            f"llama.cpp system info: {self.system_info}"
        )


def prepare_llamacpp(model: str, weights: LlamaCppWeights) -> LlamaCppSetup:
    """Check that the baseline can run and find (or write) its model file.

    Raises InvalidParameterError when llama-cpp-python is missing or the model
    is not a GGUF; called before anything is measured.
    """
    llama_cpp = import_llama_cpp()
    model_file = llamacpp_model_file(resolve_model(model), weights)
    return LlamaCppSetup(
        model_file=model_file,
        weights=weights,
        threads=physical_core_count(),
        version=str(llama_cpp.__version__),
        system_info=llama_cpp.llama_print_system_info().decode().strip(),
    )


class TimedTokens(NamedTuple):
    """One generation: when it started, when each token appeared, and the tokens."""

    start: float
    token_times: list[float]
    token_ids: list[int]


class SingleStream:
    """A ``Llama`` object for one request at a time (use as a context manager)."""

    def __init__(self, setup: LlamaCppSetup, max_context_tokens: int) -> None:
        llama_cpp = import_llama_cpp()
        self._llm = llama_cpp.Llama(
            model_path=str(setup.model_file),
            n_ctx=max_context_tokens,
            n_threads=setup.threads,
            n_threads_batch=setup.threads,
            flash_attn=True,
            verbose=False,
        )

    def generate(self, prompt: Sequence[int], num_tokens: int) -> TimedTokens:
        """Exactly ``num_tokens`` greedy tokens after ``prompt``, from a cold KV cache."""
        # reset() forgets the previous tokens, so generate() cannot reuse a cached prefix.
        self._llm.reset()
        token_times: list[float] = []
        token_ids: list[int] = []
        start = time.perf_counter()
        tokens = self._llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0)
        for token in tokens:
            token_times.append(time.perf_counter())
            token_ids.append(int(token))
            if len(token_ids) == num_tokens:
                break
        tokens.close()
        return TimedTokens(start, token_times, token_ids)

    def latency(self, prompt: Sequence[int], num_tokens: int) -> Metrics:
        """TTFT (a one-token run) and ms per output token over ``num_tokens`` tokens."""
        first = self.generate(prompt, 1)
        run = self.generate(prompt, num_tokens)
        decode_s = run.token_times[-1] - run.token_times[0]
        return {
            "ttft_s": first.token_times[0] - first.start,
            "ms_per_token": 1000 * decode_s / (num_tokens - 1),
        }

    def close(self) -> None:
        self._llm.close()

    def __enter__(self) -> SingleStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
