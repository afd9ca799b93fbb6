"""``kvserve bench prefix --restart``: what the prefix cache's disk tier saves across a restart.

One long shared prefix (``--prefix-len`` tokens, e.g. a 2,000-token system
prompt or document) followed by a short question, and the time to first
token (TTFT) of one request in three situations, all on the same model and
settings with a disk tier (``prefix_cache_dir``) in a fresh folder per run:

- ``cold``: a new engine, an empty pool and an empty folder: every token is
  computed (and the prefix's blocks are written behind);
- ``warm``: the same engine, another question: the prefix is in the pool;
- ``restart``: a new engine on the same folder, another question: the pool
  is empty and the prefix's blocks are read back from disk.

Each engine first serves an unrelated warm-up request, so that first-call
costs (kernel builds, allocations) are not counted. TTFT runs from
``add_request`` to the end of the step that produced the first token; the
writes behind the cold request are waited for before the engine is shut
down, outside the timing. Medians over ``--repeats`` runs are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve.benchmarks.workloads.prompts import random_token_ids
from kvserve.engine import LLMEngine
from kvserve.sampling_params import SamplingParams

PHASES = ("cold", "warm", "restart")


@dataclass(frozen=True)
class Measurement:
    """One request's TTFT, and how many of its prompt tokens came from a cache."""

    ttft_s: float
    hit_tokens: int
    disk_loads: int


def time_to_first_token(engine: LLMEngine, request_id: str, prompt: list[int]) -> Measurement:
    """Run one request that generates a single token; its TTFT and cache hits."""
    hits_before = engine.stats.prefix_cache_hits
    loads_before = _disk_loads(engine)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    ttft = time.perf_counter() - start
    return Measurement(
        ttft,
        engine.stats.prefix_cache_hits - hits_before,
        _disk_loads(engine) - loads_before,
    )


def _disk_loads(engine: LLMEngine) -> int:
    snapshot = engine.stats.disk_tier
    return 0 if snapshot is None else snapshot.counters.loads


def run_once(args: argparse.Namespace, folder: Path, seed: int) -> dict[str, Measurement]:
    """One cold, warm and restart measurement on a fresh folder."""
    engine_args: dict[str, Any] = dict(
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache_dir=str(folder),
    )
    rng = random.Random(seed)
    engine = LLMEngine.from_engine_args(args.model, **engine_args)
    tokenizer = engine.tokenizer
    prefix = random_token_ids(tokenizer, args.prefix_len, rng)
    questions = [random_token_ids(tokenizer, args.question_len, rng) for _ in PHASES]
    warmups = [random_token_ids(tokenizer, 64, rng) for _ in range(2)]
    time_to_first_token(engine, "warm-up-0", warmups[0])
    result = {
        "cold": time_to_first_token(engine, "cold", prefix + questions[0]),
        "warm": time_to_first_token(engine, "warm", prefix + questions[1]),
    }
    engine.shutdown()  # writes what is queued
    del engine
    engine = LLMEngine.from_engine_args(args.model, **engine_args)
    time_to_first_token(engine, "warm-up-1", warmups[1])
    result["restart"] = time_to_first_token(engine, "restart", prefix + questions[2])
    engine.shutdown()
    return result


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, Measurement]] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-prefix-") as root:
        for index in range(args.repeats):
            folder = Path(root) / f"run-{index}"
            runs.append(run_once(args, folder, seed=args.seed + index))
    medians = {phase: statistics.median(run[phase].ttft_s for run in runs) for phase in PHASES}
    ratios = {
        "warm_over_cold": medians["warm"] / medians["cold"],
        "restart_over_cold": medians["restart"] / medians["cold"],
    }
    if args.json:
        report = {
            "config": {k: v for k, v in vars(args).items() if k not in ("run", "json")},
            "median_ttft_s": medians,
            "runs": [{phase: asdict(m) for phase, m in run.items()} for run in runs],
            "ratios": ratios,
        }
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"TTFT of one request: {args.prefix_len}-token prefix + {args.question_len}-token "
        f"question; {args.model}, medians of {args.repeats} runs"
    )
    print(f"{'phase':<10}{'TTFT s':>10}{'cached tokens':>15}{'disk loads':>12}")
    last = runs[-1]
    for phase in PHASES:
        print(
            f"{phase:<10}{medians[phase]:>10.3f}"
            f"{last[phase].hit_tokens:>15}{last[phase].disk_loads:>12}"
        )
    print(
        f"warm: {ratios['warm_over_cold']:.3f}x the cold TTFT; "
        f"after a restart: {ratios['restart_over_cold']:.3f}x"
    )
    return 0
