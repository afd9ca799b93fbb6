"""``kvserve bench latency``: one request at a time, kvserve against transformers ``generate()``.

Time to first token for prompts of 128, 512 and 2048 tokens, and milliseconds
per output token over 256 tokens (batch 1: what a single user sees).
"""

from __future__ import annotations

import argparse
import functools
import gc
from typing import Any

import torch

from kvserve.benchmarks.common import Metrics, Table, median_metrics, ratio, write_json
from kvserve.benchmarks.corpus import prompts_of_lengths
from kvserve.benchmarks.engine_driver import BenchRequest, drive
from kvserve.benchmarks.throughput import add_common_args
from kvserve.engine import LLMEngine
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.loader import ModelSource


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("latency", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--output-len", type=int, default=256)
    add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(run=run)


def kvserve_latency(engine: LLMEngine, prompt: list[int], output_len: int) -> Metrics:
    # Repetitions reuse the prompt: start each from a cold prefix cache so TTFT is a real prefill.
    engine.reset_prefix_cache()
    ttft = drive(engine, [BenchRequest(prompt, 1)]).traces[0].ttft
    engine.reset_prefix_cache()
    trace = drive(engine, [BenchRequest(prompt, output_len)]).traces[0]
    decode_s = trace.finish - trace.token_times[0]
    return {"ttft_s": ttft, "ms_per_token": 1000 * decode_s / (output_len - 1)}


def measure_kvserve(
    args: argparse.Namespace,
) -> tuple[dict[int, Metrics], list[list[int]], ModelSource, torch.dtype, int]:
    """kvserve's medians per prompt length; the engine is freed on return."""
    model, engine_args = engine_kwargs(args)
    engine = LLMEngine.from_engine_args(model, **engine_args)
    prompts = prompts_of_lengths(engine.tokenizer, args.prompt_lens, args.seed)
    warmup = functools.partial(kvserve_latency, engine, prompts[0][:32], 8)
    results = {}
    for prompt in prompts:
        results[len(prompt)], _ = median_metrics(
            functools.partial(kvserve_latency, engine, prompt, args.output_len),
            args.repetitions,
            warmup=warmup,
        )
    print(
        f"kvserve runs in {engine.runner.describe_precision()}; baselines in {engine.runner.dtype}"
    )
    pad_id = engine.tokenizer.pad_token_id or 0
    return results, prompts, engine.source, engine.runner.dtype, pad_id


def run(args: argparse.Namespace) -> int:
    from kvserve.benchmarks import hf_baseline

    results: dict[str, dict[int, Metrics]] = {"hf_generate": {}}
    results["kvserve"], prompts, source, dtype, pad_id = measure_kvserve(args)
    gc.collect()
    warm = prompts[0][:32]
    if not args.no_baselines:
        hf_model = hf_baseline.load_hf_model(source, dtype)
        for prompt in prompts:
            results["hf_generate"][len(prompt)], _ = median_metrics(
                functools.partial(
                    hf_baseline.single_request_latency, hf_model, prompt, args.output_len, pad_id
                ),
                args.repetitions,
                warmup=functools.partial(
                    hf_baseline.single_request_latency, hf_model, warm, 8, pad_id
                ),
            )

    table = Table(["prompt tokens", "system", "TTFT ms", "ms/token", "tok/s", "decode vs HF"])
    for prompt_len, ours in results["kvserve"].items():
        theirs = results["hf_generate"].get(prompt_len)
        for name, metrics in (("kvserve", ours), ("hf_generate", theirs)):
            if metrics is None:
                continue
            speedup = (
                ratio(1 / ours["ms_per_token"], 1 / theirs["ms_per_token"]) if theirs else "n/a"
            )
            table.add(
                prompt_len,
                name,
                1000 * metrics["ttft_s"],
                metrics["ms_per_token"],
                1000 / metrics["ms_per_token"],
                speedup if name == "kvserve" else "",
            )
    print(
        f"latency: batch 1, {args.output_len} output tokens, dtype {dtype}, median of {args.repetitions}"
    )
    print(table.render())
    if args.json:
        write_json(args.json, "latency", {"args": vars(args) | {"run": None}, "results": results})
    return 0
