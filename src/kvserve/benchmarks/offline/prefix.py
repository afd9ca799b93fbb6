"""``kvserve bench prefix``: what prefix caching saves when requests share a long prefix.

The workload is chat traffic in miniature: 64 requests share one 1024-token
system prompt, each adds its own 32-token question and generates 64 tokens
(``ignore_eos``, so every run does the same work). It runs on two engines in
one process, identical but for ``enable_prefix_caching``; both get the same
KV pool, big enough for the whole workload, so neither preempts.

Every request is submitted at once, as an offline batch. Total time runs from
submission to the last token; time to first token (TTFT) is, per request, the
time from submission to the end of the step that produced its first token.
Each engine warms up first (a small run of the same shape), then the two
alternate for ``--repeats`` runs, each starting from an empty prefix cache;
the medians are reported. The hit rate is hit tokens over prompt tokens.

``--restart`` measures the prefix cache's disk tier instead: the TTFT of one
request cold, warm in the pool and after a restart (``prefix_restart.py``).

Run ``python -m kvserve.benchmarks.offline.prefix --help``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvserve.benchmarks.offline import prefix_restart
from kvserve.benchmarks.workloads.prompts import random_token_ids
from kvserve.engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.trace.cli import add_trace_arg, open_trace


@dataclass(frozen=True)
class Workload:
    """Token ids of every prompt, and how many tokens each request generates."""

    prompts: list[list[int]]
    num_prompt_tokens: int
    output_len: int


@dataclass(frozen=True)
class RunResult:
    """One pass over the workload."""

    total_time_s: float
    mean_ttft_s: float
    hit_rate: float
    output_tokens_per_s: float


def make_workload(
    engine: LLMEngine,
    num_requests: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    system_prompt = random_token_ids(engine.tokenizer, prefix_len, rng)
    prompts = [
        system_prompt + random_token_ids(engine.tokenizer, question_len, rng)
        for _ in range(num_requests)
    ]
    return Workload(prompts, sum(map(len, prompts)), output_len)


# Request ids stay unique across runs on one engine.
_request_numbers = itertools.count()


def run_workload(engine: LLMEngine, workload: Workload) -> RunResult:
    """Submit every request, step until all finish, and time it from a cold prefix cache."""
    if not engine.reset_prefix_cache():
        raise RuntimeError("the engine still holds requests; cannot start from a cold cache")
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    hits_before = engine.stats.prefix_cache_hits
    start = time.perf_counter()
    submitted: dict[str, float] = {}
    for prompt in workload.prompts:
        request_id = f"bench-prefix-{next(_request_numbers)}"
        submitted[request_id] = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first_token: dict[str, float] = {}
    num_output_tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id not in first_token:
                first_token[output.request_id] = now
            if output.finished:
                num_output_tokens += len(output.outputs[0].token_ids)
    total = time.perf_counter() - start
    ttfts = [first_token[request_id] - submitted[request_id] for request_id in submitted]
    hits = engine.stats.prefix_cache_hits - hits_before
    return RunResult(
        total_time_s=total,
        mean_ttft_s=statistics.fmean(ttfts),
        hit_rate=hits / workload.num_prompt_tokens,
        output_tokens_per_s=num_output_tokens / total,
    )


def median_result(results: list[RunResult]) -> RunResult:
    """The median of each figure over the runs (figures may come from different runs)."""
    return RunResult(
        *(statistics.median(getattr(r, field.name) for r in results) for field in fields(RunResult))
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``prefix`` on a ``bench`` sub-command's subparsers (``kvserve bench prefix``)."""
    parser = subparsers.add_parser(
        "prefix",
        help="prefix caching on vs off on requests sharing a long system prompt",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared prompt tokens")
    parser.add_argument("--question-len", type=int, default=32, help="own prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated each")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt text")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="instead: TTFT of one request with the prefix cold, warm in the pool, and "
        "read from the disk tier after a restart (uses --prefix-len, --question-len, "
        "--block-size, --max-num-batched-tokens, --dtype, --repeats, --seed)",
    )
    add_trace_arg(parser)


def run(args: argparse.Namespace) -> int:
    if args.restart:
        return prefix_restart.run(args)
    num_tokens_each = args.prefix_len + args.question_len + args.output_len
    # Room for the whole workload at once, the null block included: nobody preempts.
    num_blocks = args.num_requests * -(-num_tokens_each // args.block_size) + 1
    engine_args = dict(
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    with open_trace(args.trace) as trace:
        engines = {
            setting: LLMEngine.from_engine_args(
                args.model, enable_prefix_caching=setting == "on", **engine_args
            )
            for setting in ("off", "on")
        }
        for engine in engines.values():
            engine.set_trace(trace)
        shape = (args.num_requests, args.prefix_len, args.question_len, args.output_len)
        workload = make_workload(engines["on"], *shape, seed=args.seed)
        warmup = make_workload(
            engines["on"], 4, min(args.prefix_len, 128), 16, 8, seed=args.seed + 1
        )
        for engine in engines.values():
            run_workload(engine, warmup)
        runs: dict[str, list[RunResult]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for setting, engine in engines.items():  # alternate, so drifting load hits both alike
                runs[setting].append(run_workload(engine, workload))
    medians = {setting: median_result(results) for setting, results in runs.items()}
    ratios = {
        "total_time_speedup": medians["off"].total_time_s / medians["on"].total_time_s,
        "mean_ttft_speedup": medians["off"].mean_ttft_s / medians["on"].mean_ttft_s,
    }
    if args.json:
        report = {
            "config": {k: v for k, v in vars(args).items() if k not in ("run", "json")},
            "median": {setting: asdict(result) for setting, result in medians.items()},
            "runs": {setting: [asdict(r) for r in results] for setting, results in runs.items()},
            "ratios": ratios,
        }
        print(json.dumps(report, indent=2))
    else:
        print_table(args, medians, ratios)
    return 0


def print_table(
    args: argparse.Namespace, medians: dict[str, RunResult], ratios: dict[str, float]
) -> None:
    print(
        f"{args.num_requests} requests: {args.prefix_len}-token shared prefix + "
        f"{args.question_len}-token question, {args.output_len} output tokens; "
        f"{args.model}, medians of {args.repeats} runs"
    )
    print(
        f"{'prefix caching':<16}{'total s':>10}{'mean TTFT s':>14}{'hit rate':>10}{'out tok/s':>11}"
    )
    for setting, result in medians.items():
        print(
            f"{setting:<16}{result.total_time_s:>10.2f}{result.mean_ttft_s:>14.3f}"
            f"{result.hit_rate:>10.1%}{result.output_tokens_per_s:>11.1f}"
        )
    print(
        f"caching on: total time {ratios['total_time_speedup']:.2f}x shorter, "
        f"mean TTFT {ratios['mean_ttft_speedup']:.2f}x shorter"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.offline.prefix")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
