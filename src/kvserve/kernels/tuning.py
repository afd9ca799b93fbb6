"""Kernel choices measured on the machine that runs them, once, then cached beside the kernels.

The quantized linear kernels have two paths (``quant_ops.py``): activations
rounded to int8 blocks, one stream through the weight (best for a few rows of
activations), and weight panels dequantized once per call and multiplied in
bfloat16 or float32 (best for many rows). Where one overtakes the other
depends on the core (its VNNI and BF16 throughput, its caches), on the thread
count and on the weights' types: a constant measured on one CPU was wrong on
another. So the first time a quantized model is loaded, the engine times both
paths on the model's own first layer at row counts from 2 up, and takes the
smallest count from which the many-row path is no slower at every larger
count it measured. Unless the machine was busy with other work while it
measured (the load average above the CPU count), the choice is written as
JSON next to the compiled library, named after it (new kernels, another
compiler or another CPU's flags measure again), and keyed by the thread
count and the layer's types and shapes. ``KVSERVE_QUANT_MANY_ROWS`` still overrides it, and
``KVSERVE_KERNEL_TUNING=0`` keeps the library's compiled default (the test
suite does, so that which path a test runs never depends on a timing).

The same goes for how the block-32 kernels prefetch their weight stream:
non-temporally (``PREFETCHNTA``) or into L2. Which is faster is a property of
the core (1.1-1.6x for the first on Zen 4, half the rate on an Ice Lake), so a
model with block-32 weights has both timed once, on a Q8_0 stream larger
than the last-level cache, and the choice is cached the same way.

Where the build has them (AVX-512 with VNNI), the block-32 kernels can also take
their weights sixteen rows at a time in 512-bit registers instead of eight in
256-bit ones: half the instructions per product, the same floats, but whether
that is faster depends on the core's 512-bit ports and clocks (on an Ice Lake
it ran prompts and batches 1.25-1.5x faster). A model with block-32 weights has
both timed on its first layer at 1 to 8 rows, and the row count from which the
wide tiles were no slower is used and cached the same way.

Float32 weights have two paths too: the C kernel (best for a few rows) and
BLAS (PyTorch's matmul, best for many); the row count from which BLAS was no
slower on the model's first layer is used and cached the same way (the crossover
was 512 rows on an AVX2 EPYC, 64 on an Ice Lake).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from kvserve.kernels.quant_weight import QuantWeight
from kvserve.private_cache import atomic_target, is_trusted_file

logger = logging.getLogger(__name__)

# Row counts timed, smallest first. The many-row path's lead only grows with rows (its
# dequantizing is paid once per call), so timing stops once it has won at
# ``SETTLED_WINS`` counts in a row.
CANDIDATE_ROWS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SETTLED_WINS = 3
# Timed calls per path and row count, after one warm-up call. The fastest counts: other
# work on the machine (or a thread the OS parked) only ever adds time to a call.
REPEATS = 5
# A threshold no batch reaches: the int8 path for every row count.
NEVER = 1 << 40
# The JSON's layout; another version is measured again. 2: under KVSERVE_CPU_ISA=avx2 or
# avx512, version 1's float32 timings ran MKL's AVX-512 kernels (MKL_ENABLE_INSTRUCTIONS
# was not set), so they are measured again.
FORMAT_VERSION = 2
# Set to 0 to keep the compiled defaults instead of measuring.
TUNING_ENV = "KVSERVE_KERNEL_TUNING"

# ``(many-row path seconds, int8 path seconds)`` of one call over the layer, by row count.
Timings = Mapping[int, tuple[float, float]]


@dataclass(frozen=True)
class ManyRowsChoice:
    """Where the quantized kernels switch to the many-row path, and how that was decided.

    source: ``measured`` (now), ``cached`` (measured before on this machine),
    ``environment`` (``KVSERVE_QUANT_MANY_ROWS``).
    """

    rows: int
    source: str
    threads: int
    timings: dict[int, tuple[float, float]] = field(default_factory=dict)

    def describe(self) -> str:
        """A line for benchmark output."""
        where = (
            "at no row count measured"
            if self.rows >= NEVER
            else f"from {self.rows} rows of activations"
        )
        how = {
            "measured": "measured on this machine now",
            "cached": "measured on this machine before",
            "environment": "set by KVSERVE_QUANT_MANY_ROWS",
        }.get(self.source, self.source)
        return (
            f"quantized kernels: the dequantized-panel path {where}, the int8 path below, at "
            f"{self.threads} threads ({how})"
        )


# The choice of the last quantized model loaded in this process (the benchmarks print it).
LAST_CHOICE: ManyRowsChoice | None = None


@dataclass(frozen=True)
class StreamChoice:
    """Whether the block-32 kernels prefetch their weight stream non-temporally, and how
    that was decided (``measured`` or ``cached``); timings: seconds of one pass over the
    measuring stream, by ``nta`` and ``l2``."""

    nta: bool
    source: str
    timings: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        how = "now" if self.source == "measured" else "before"
        where = "non-temporally" if self.nta else "into L2"
        return f"block-32 weight streams prefetched {where} (measured on this machine {how})"


# The prefetch choice of the last model with block-32 weights loaded in this process.
LAST_STREAM: StreamChoice | None = None


@dataclass(frozen=True)
class WideChoice:
    """From how many rows of activations the block-32 kernels use their 512-bit tiles
    (:data:`NEVER`: not at all), and how that was decided (``measured`` or ``cached``);
    timings: ``(wide seconds, narrow seconds)`` of one call over the layer, by row count."""

    rows: int
    source: str
    timings: dict[int, tuple[float, float]] = field(default_factory=dict)

    def describe(self) -> str:
        how = "now" if self.source == "measured" else "before"
        plural = "" if self.rows == 1 else "s"
        where = "never" if self.rows >= NEVER else f"from {self.rows} row{plural}"
        return f"512-bit block-32 tiles {where} (measured on this machine {how})"


# The 512-bit tile choice of the last model with block-32 weights loaded in this process.
LAST_WIDE: WideChoice | None = None

# Row counts the 512-bit tiles are timed at: decode of one sequence, and a few rows
# (speculative proposals, small batches), where the weight's unpacking is shared.
WIDE_ROWS = (1, 2, 4, 8)


@dataclass(frozen=True)
class BlasChoice:
    """From how many rows of activations float32 weights go to BLAS rather than the C
    kernel (:data:`NEVER`: never), and how that was decided (``measured`` or ``cached``);
    timings: ``(BLAS seconds, C kernel seconds)`` of one call over the layer, by row count."""

    rows: int
    source: str
    timings: dict[int, tuple[float, float]] = field(default_factory=dict)

    def describe(self) -> str:
        how = "now" if self.source == "measured" else "before"
        where = "never" if self.rows >= NEVER else f"from {self.rows} rows"
        return f"float32 weights: BLAS {where}, the C kernel below (measured on this machine {how})"


# The float32 choice of the last model with float32 weights loaded in this process.
LAST_BLAS: BlasChoice | None = None


def describe_choice() -> str | None:
    """:data:`LAST_CHOICE` (and :data:`LAST_STREAM`, :data:`LAST_WIDE`) as a line for
    benchmark output; None before a quantized model."""
    if LAST_CHOICE is None:
        return LAST_BLAS.describe() if LAST_BLAS is not None else None
    lines = [LAST_CHOICE.describe()]
    lines += [c.describe() for c in (LAST_STREAM, LAST_WIDE, LAST_BLAS) if c is not None]
    return "; ".join(lines)


def crossover(timings: Timings) -> int:
    """The smallest measured row count from which the many-row path was no slower at every
    larger measured count; :data:`NEVER` when it lost at the largest."""
    choice = NEVER
    for rows in sorted(timings, reverse=True):
        many, int8 = timings[rows]
        if many > int8:
            break
        choice = rows
    return choice


def layer_signature(weights: Sequence[QuantWeight]) -> str:
    """The types and shapes of ``weights``: what the measurement depends on besides the
    machine and the thread count."""
    parts = []
    for weight in weights:
        types = "+".join(
            f"{s.qtype.name}{'r' if s.repacked else ''}x{s.rows}" for s in weight.segments
        )
        parts.append(f"{types}:{weight.in_features}")
    return ",".join(parts)


class _Weight(Protocol):
    """What :func:`measure` needs of a weight: the width of the rows it multiplies."""

    @property
    def in_features(self) -> int: ...


_W = TypeVar("_W", bound=_Weight)


def measure(
    linear: Callable[[torch.Tensor, _W], object],
    set_rows: Callable[[int], None],
    weights: Sequence[_W],
    clock: Callable[[], float] = time.perf_counter,
    candidates: Sequence[int] = CANDIDATE_ROWS,
) -> dict[int, tuple[float, float]]:
    """Time ``linear`` over every weight at each candidate row count, with the path that
    ``set_rows`` switches forced on (threshold 1) and off (:data:`NEVER`), alternating;
    the fastest of :data:`REPEATS` calls of each. Stops once the first has won at
    :data:`SETTLED_WINS` counts in a row."""
    timings: dict[int, tuple[float, float]] = {}
    wins = 0
    generator = torch.Generator().manual_seed(0)
    for rows in candidates:
        inputs = [torch.randn(rows, w.in_features, generator=generator) for w in weights]
        samples: dict[int, list[float]] = {1: [], NEVER: []}
        for repeat in range(REPEATS + 1):
            for threshold in (1, NEVER):
                set_rows(threshold)
                start = clock()
                for x, weight in zip(inputs, weights, strict=True):
                    linear(x, weight)
                if repeat:  # the first call of each path warms caches and pages
                    samples[threshold].append(clock() - start)
        timings[rows] = (min(samples[1]), min(samples[NEVER]))
        wins = wins + 1 if timings[rows][0] <= timings[rows][1] else 0
        if wins >= SETTLED_WINS:
            break
    return timings


class TuningCache:
    """The JSON of one kernel library's measured choices (a missing, foreign-owned or
    unreadable file is an empty cache; writes are whole-file renames)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_library(cls, library: Path) -> TuningCache:
        return cls(library.with_name(f"{library.stem}.tuning.json"))

    def _read(self) -> dict[str, dict[str, object]]:
        if not is_trusted_file(self.path):
            return {}
        try:
            document = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
            return {}
        entries = document.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str, name: str = "quant_many_rows") -> int | None:
        """The row count kept under ``key`` as ``name`` (the many-row threshold, or
        ``x8_wide_rows``); None when there is none that makes sense."""
        entry = self._read().get(key)
        rows = entry.get(name) if isinstance(entry, dict) else None
        if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1:
            return rows
        return None

    def put(self, key: str, rows: int, timings: Timings, name: str = "quant_many_rows") -> None:
        self._put(
            key, {name: rows, "timings_s": {str(m): list(pair) for m, pair in timings.items()}}
        )

    def get_stream(self, key: str) -> bool | None:
        entry = self._read().get(key)
        nta = entry.get("stream_nta") if isinstance(entry, dict) else None
        return nta if isinstance(nta, bool) else None

    def put_stream(self, key: str, nta: bool, timings: Mapping[str, float]) -> None:
        self._put(key, {"stream_nta": nta, "timings_s": dict(timings)})

    def _put(self, key: str, entry: dict[str, object]) -> None:
        entries = self._read()
        entries[key] = entry
        try:
            with atomic_target(self.path, ".json") as tmp:
                tmp.write_text(json.dumps({"version": FORMAT_VERSION, "entries": entries}))
        except OSError as exc:  # a read-only cache: measured again next time
            logger.warning("could not keep the kernel tuning in %s: %s", self.path, exc)


def tune_quant_many_rows(
    linear: Callable[[torch.Tensor, QuantWeight], object],
    set_rows: Callable[[int], None],
    weights: Sequence[QuantWeight],
    cache: TuningCache | None,
    threads: int,
    measure_fn: Callable[..., dict[int, tuple[float, float]]] = measure,
) -> ManyRowsChoice:
    """The many-row threshold for ``weights`` at ``threads`` threads: cached, or measured
    (and cached); applied through ``set_rows`` either way."""
    global LAST_CHOICE
    key = f"threads={threads};{layer_signature(weights)}"
    start = time.perf_counter()
    rows, timings = _rows_choice(
        cache, key, "quant_many_rows", lambda: measure_fn(linear, set_rows, weights)
    )
    if timings is None:
        choice = ManyRowsChoice(rows, "cached", threads)
    else:
        choice = ManyRowsChoice(rows, "measured", threads, timings)
        logger.info("%s, in %.1f s", choice.describe(), time.perf_counter() - start)
    set_rows(choice.rows)
    LAST_CHOICE = choice
    return choice


def _rows_choice(
    cache: TuningCache | None,
    key: str,
    name: str,
    measure_now: Callable[[], dict[int, tuple[float, float]]],
) -> tuple[int, dict[int, tuple[float, float]] | None]:
    """A row count kept in ``cache`` under ``key`` (and no timings), or the crossover of
    ``measure_now()``'s timings (kept unless the machine was busy) and those timings."""
    rows = cache.get(key, name) if cache is not None else None
    if rows is not None:
        return rows, None
    timings = measure_now()
    rows = crossover(timings)
    if cache is not None and not machine_busy():
        cache.put(key, rows, timings, name)
    return rows, timings


def record_environment_choice(rows: int, threads: int) -> ManyRowsChoice:
    """Note a threshold set by ``KVSERVE_QUANT_MANY_ROWS`` (nothing is measured)."""
    global LAST_CHOICE
    LAST_CHOICE = ManyRowsChoice(rows, "environment", threads)
    return LAST_CHOICE


def stream_bytes() -> int:
    """The size of the stream the prefetch choice is measured on: four times the last-level
    cache (``/sys``; 32 MiB where it does not say), from 128 to 512 MiB, so that the
    weights come from memory as a model's do."""
    cache = 32 << 20
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        cache = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except (OSError, ValueError, IndexError):
        pass
    return min(max(4 * cache, 128 << 20), 512 << 20)


def measure_stream(
    linear: Callable[[torch.Tensor, QuantWeight], object],
    set_nta: Callable[[bool], None],
    weight: QuantWeight,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """One activation row against ``weight`` with non-temporal prefetches and with prefetches
    into L2, alternating; the fastest of :data:`REPEATS` passes of each."""
    x = torch.randn(1, weight.in_features, generator=torch.Generator().manual_seed(0))
    samples: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(REPEATS + 1):
        for nta in (True, False):
            set_nta(nta)
            start = clock()
            linear(x, weight)
            if repeat:
                samples[nta].append(clock() - start)
    return {"nta": min(samples[True]), "l2": min(samples[False])}


def tune_stream_prefetch(
    linear: Callable[[torch.Tensor, QuantWeight], object],
    set_nta: Callable[[bool], None],
    make_stream: Callable[[], QuantWeight],
    cache: TuningCache | None,
    threads: int,
) -> StreamChoice:
    """Whether the block-32 kernels should prefetch non-temporally at ``threads`` threads:
    cached, or measured on ``make_stream()`` (a Q8_0 weight larger than the caches) and
    cached; applied through ``set_nta`` either way. On Zen 4 non-temporal lines streamed
    1.1-1.6x faster; on an Ice Lake they halved the rate (10 against 22 GB/s)."""
    global LAST_STREAM
    key = f"stream;threads={threads}"
    nta = cache.get_stream(key) if cache is not None else None
    if nta is not None:
        choice = StreamChoice(nta, "cached")
    else:
        timings = measure_stream(linear, set_nta, make_stream())
        choice = StreamChoice(timings["nta"] <= timings["l2"], "measured", timings)
        logger.info("%s: %s", choice.describe(), timings)
        if cache is not None and not machine_busy():
            cache.put_stream(key, choice.nta, timings)
    set_nta(choice.nta)
    LAST_STREAM = choice
    return choice


def tune_x8_wide(
    linear: Callable[[torch.Tensor, QuantWeight], object],
    set_rows: Callable[[int], None],
    weights: Sequence[QuantWeight],
    cache: TuningCache | None,
    threads: int,
    measure_fn: Callable[..., dict[int, tuple[float, float]]] = measure,
) -> WideChoice:
    """From how many rows the block-32 kernels should use their 512-bit tiles on
    ``weights`` (a layer's block-32 weights) at ``threads`` threads: cached, or measured
    at :data:`WIDE_ROWS` (and cached); applied through ``set_rows`` either way."""
    global LAST_WIDE
    LAST_WIDE = _apply_choice(
        WideChoice,
        cache,
        f"x8wide;threads={threads};{layer_signature(weights)}",
        "x8_wide_rows",
        lambda: measure_fn(linear, set_rows, weights, candidates=WIDE_ROWS),
        set_rows,
    )
    return LAST_WIDE


def tune_f32_blas_rows(
    linear: Callable[[torch.Tensor, _W], object],
    set_rows: Callable[[int], None],
    weights: Sequence[_W],
    signature: str,
    cache: TuningCache | None,
    threads: int,
    measure_fn: Callable[..., dict[int, tuple[float, float]]] = measure,
) -> BlasChoice:
    """From how many rows float32 ``weights`` (a layer's, described by ``signature``)
    should go to BLAS at ``threads`` threads: cached, or measured (BLAS forced on by
    ``set_rows(1)``, the C kernel by ``set_rows(NEVER)``) and cached; applied through
    ``set_rows`` either way."""
    global LAST_BLAS
    LAST_BLAS = _apply_choice(
        BlasChoice,
        cache,
        f"f32blas;threads={threads};{signature}",
        "f32_blas_rows",
        lambda: measure_fn(linear, set_rows, weights),
        set_rows,
    )
    return LAST_BLAS


_C = TypeVar("_C", WideChoice, BlasChoice)


def _apply_choice(
    kind: Callable[[int, str, dict[int, tuple[float, float]]], _C],
    cache: TuningCache | None,
    key: str,
    name: str,
    measure_now: Callable[[], dict[int, tuple[float, float]]],
    set_rows: Callable[[int], None],
) -> _C:
    """A row-count choice (``kind``) read from ``cache`` or measured (and logged), applied
    through ``set_rows``."""
    rows, timings = _rows_choice(cache, key, name, measure_now)
    choice = kind(rows, "cached", {}) if timings is None else kind(rows, "measured", timings)
    if timings is not None:
        logger.info("%s: %s", choice.describe(), timings)
    set_rows(choice.rows)
    return choice


def machine_busy() -> bool:
    """Whether other work kept the CPUs busy while the engine measured (the load average
    above the CPU count): such a measurement is used, but not kept for later starts."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def tuning_enabled() -> bool:
    """False when ``KVSERVE_KERNEL_TUNING`` is ``0`` (or ``false``/``no``/``off``)."""
    return os.environ.get(TUNING_ENV, "").strip().lower() not in ("0", "false", "no", "off")


_LAYER_INDEX = re.compile(r"^(.*?\.)?(\d+)\.")


_T = TypeVar("_T")


def first_layer(named: Sequence[tuple[str, _T]]) -> list[_T]:
    """The weights of the first numbered layer among ``named`` (module names as
    ``model.layers.0.mlp.down_proj``, in module order); the first four when none is
    numbered."""
    for name, _ in named:
        match = _LAYER_INDEX.match(name)
        if match is not None:
            prefix = match.group(0)
            return [weight for other, weight in named if other.startswith(prefix)]
    return [weight for _, weight in named[:4]]
