"""``kvserve bench chunked-prefill``: what long prompts do to the streams already decoding.

16 requests decode (128-token prompts, 384 output tokens each). Once they
are under way, a 2048-token prompt arrives every ``--arrival-every`` steps.
With chunked prefill off, each arrival is prefilled in one long step and every
decoding stream stalls for it; with it on, the prompt is cut into chunks that
share steps with the decodes. The figure is the p99 inter-token latency of
the 16 decoding streams, on and off, in the same process.
"""

from __future__ import annotations

import argparse
import functools
import gc
from typing import Any

from kvserve.benchmarks.common import Metrics, Table, add_common_args, median_metrics, write_json
from kvserve.benchmarks.offline.engine_driver import BenchRequest, drive
from kvserve.benchmarks.workloads.prompts import prompts_of_lengths
from kvserve.engine import LLMEngine
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.trace.cli import open_trace


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chunked-prefill", help=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--num-decoding", type=int, default=16)
    parser.add_argument("--decode-output-len", type=int, default=384)
    parser.add_argument("--num-long", type=int, default=8, help="long prompts arriving")
    parser.add_argument("--long-prompt-len", type=int, default=2048)
    parser.add_argument("--arrival-every", type=int, default=40, help="steps between arrivals")
    parser.add_argument(
        "--chunk-budget", type=int, default=256, help="max_num_batched_tokens when on"
    )
    add_common_args(parser)
    add_engine_args(parser, exclude=("max_num_batched_tokens", "enable_chunked_prefill"))
    parser.set_defaults(run=run)


def workload(engine: LLMEngine, args: argparse.Namespace) -> list[BenchRequest]:
    lengths = [128] * args.num_decoding + [args.long_prompt_len] * args.num_long
    prompts = prompts_of_lengths(engine.tokenizer, lengths, args.seed)
    decoding = [BenchRequest(p, args.decode_output_len) for p in prompts[: args.num_decoding]]
    # The first arrival waits until every stream is decoding.
    long = [
        BenchRequest(p, 8, arrival_step=10 + i * args.arrival_every)
        for i, p in enumerate(prompts[args.num_decoding :])
    ]
    return decoding + long


def measure(engine: LLMEngine, requests: list[BenchRequest], num_decoding: int) -> Metrics:
    # Repetitions reuse the prompts: a warm prefix cache would skip the very prefills measured.
    engine.reset_prefix_cache()
    result = drive(engine, requests)
    decoders = range(num_decoding)
    return {
        "p99_itl_ms": 1000 * result.itl_percentile(99, decoders),
        "p50_itl_ms": 1000 * result.itl_percentile(50, decoders),
        "max_itl_ms": 1000 * result.itl_percentile(100, decoders),
        "wall_s": result.wall_s,
    }


def run(args: argparse.Namespace) -> int:
    model, engine_args = engine_kwargs(args)
    results: dict[str, Metrics] = {}
    longest = args.long_prompt_len + 8 + args.num_decoding
    settings = {
        "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": args.chunk_budget},
        # Off, a step must fit a whole prompt beside the decodes.
        "unchunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": max(longest, 512)},
    }
    with open_trace(args.trace) as trace:
        for name, setting in settings.items():
            engine = LLMEngine.from_engine_args(model, **engine_args, **setting)
            engine.set_trace(trace)
            requests = workload(engine, args)
            results[name], _ = median_metrics(
                functools.partial(measure, engine, requests, args.num_decoding),
                args.repetitions,
                warmup=functools.partial(
                    drive, engine, [BenchRequest(requests[0].prompt_token_ids, 4)]
                ),
            )
            del engine
            gc.collect()
    table = Table(["chunked prefill", "budget", "p50 ITL ms", "p99 ITL ms", "max ITL ms", "wall s"])
    for name, metrics in results.items():
        table.add(
            "on" if name == "chunked" else "off",
            settings[name]["max_num_batched_tokens"],
            metrics["p50_itl_ms"],
            metrics["p99_itl_ms"],
            metrics["max_itl_ms"],
            metrics["wall_s"],
        )
    print(
        f"chunked prefill: {args.num_decoding} streams decoding, {args.num_long} prompts of "
        f"{args.long_prompt_len} tokens arriving every {args.arrival_every} steps; median of {args.repetitions}"
    )
    print(table.render())
    on, off = results["chunked"]["p99_itl_ms"], results["unchunked"]["p99_itl_ms"]
    print(f"p99 inter-token latency with chunked prefill is {on / off:.2f} of what it is without")
    if args.json:
        write_json(
            args.json, "chunked-prefill", {"args": vars(args) | {"run": None}, "results": results}
        )
    return 0
