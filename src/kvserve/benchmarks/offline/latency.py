"""``kvserve bench latency``: one request at a time, kvserve against transformers and llama.cpp.

Time to first token for prompts of 128, 512 and 2048 tokens, and milliseconds
per output token over 256 tokens (batch 1: what a single user sees). The
baselines: transformers ``generate()`` (``generate``), llama.cpp's own
``llama-bench`` (``llama-bench``: prompt processing of each prompt length, and
decode at that context depth; the fair llama.cpp reference) and llama.cpp's
high-level ``Llama.generate()`` through its Python binding (``llamacpp``).
llama.cpp runs the GGUF file kvserve loaded, as stored, unless
``--llamacpp-weights bf16`` asks for a BF16 copy. kvserve's row carries its
speed over each baseline's: decode (ms/token) and, against ``llama-bench``,
prefill (TTFT) too; above 1.00x kvserve is the faster.

With ``llama-bench`` among the baselines, the two systems take turns: each
repetition measures kvserve at every prompt length, then ``llama-bench`` once
(``-r 1``) on the same lengths, and the medians are over those rounds. A
machine whose memory bandwidth drifts from one minute to the next (a shared
cloud host) then moves both columns alike instead of one; ``--no-interleave``
runs all of kvserve's repetitions first and ``llama-bench``'s after.
"""

from __future__ import annotations

import argparse
import functools
import gc
from collections.abc import Callable
from typing import Any

import torch

from kvserve.attention.flex_compile import COMPILE_STATS
from kvserve.benchmarks.baselines.llamacpp_baseline import (
    LLAMACPP,
    LlamaCppSetup,
    SingleStream,
    add_llamacpp_args,
    in_own_process,
    prepare_llamacpp,
)
from kvserve.benchmarks.baselines.llamacpp_tools import ToolRun, llama_bench, prepare_tool_run
from kvserve.benchmarks.common import (
    Metrics,
    Table,
    add_baselines_arg,
    add_common_args,
    cpu_info,
    median_metrics,
    median_of_runs,
    ratio,
    selected_baselines,
    write_json,
)
from kvserve.benchmarks.offline.engine_driver import BenchRequest, drive
from kvserve.benchmarks.offline.roofline import baseline_dtype
from kvserve.benchmarks.workloads.prompts import prompts_of_lengths
from kvserve.engine import LLMEngine
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.kernels.tuning import describe_choice
from kvserve.loader import ModelSource
from kvserve.trace.cli import open_trace
from kvserve.worker.model_runner import physical_core_count

LLAMA_BENCH = "llama-bench"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("latency", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--output-len", type=int, default=256)
    add_baselines_arg(parser, choices=("generate", LLAMA_BENCH, LLAMACPP), default=("generate",))
    parser.add_argument(
        "--no-interleave",
        action="store_true",
        help="run kvserve's repetitions, then llama-bench's (default: they take turns)",
    )
    add_llamacpp_args(parser)
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
    args: argparse.Namespace, between: Callable[[], None] | None = None
) -> tuple[dict[int, Metrics], list[list[int]], ModelSource, torch.dtype, int, torch.device]:
    """kvserve's medians per prompt length; the engine is freed on return.

    ``between``: called after each repetition of every prompt length (another system's
    turn); None: each length's repetitions run back to back.

    Also returns what the transformers baseline needs: the prompts, the model's source,
    the dtype, the pad token id and the device kvserve ran on.
    """
    model, engine_args = engine_kwargs(args)
    with open_trace(args.trace) as trace:
        engine = LLMEngine.from_engine_args(model, **engine_args)
        engine.set_trace(trace)
        prompts = prompts_of_lengths(engine.tokenizer, args.prompt_lens, args.seed)
        warmup = functools.partial(kvserve_latency, engine, prompts[0][:32], 8)
        results = {}
        if between is None:
            for prompt in prompts:
                results[len(prompt)], _ = median_metrics(
                    functools.partial(kvserve_latency, engine, prompt, args.output_len),
                    args.repetitions,
                    warmup=warmup,
                )
        else:
            warmup()
            runs: dict[int, list[Metrics]] = {len(prompt): [] for prompt in prompts}
            for _ in range(args.repetitions):
                for prompt in prompts:
                    runs[len(prompt)].append(kvserve_latency(engine, prompt, args.output_len))
                between()
            results = {length: median_of_runs(samples) for length, samples in runs.items()}
        print(
            f"kvserve runs in {engine.runner.describe_precision()}; "
            f"transformers baselines in {baseline_dtype(engine)}"
        )
        pad_id = engine.tokenizer.pad_token_id or 0
        if (compiles := COMPILE_STATS.describe()) is not None:
            print(compiles)
        if (tuning := describe_choice()) is not None:
            print(tuning)
        device = engine.runner.device
        return results, prompts, engine.source, baseline_dtype(engine), pad_id, device


def measure_llamacpp(
    args: argparse.Namespace, setup: LlamaCppSetup, prompts: list[list[int]]
) -> dict[int, Metrics]:
    """llama.cpp's medians per prompt length, one request at a time (high-level API)."""
    max_context = max(len(p) for p in prompts) + args.output_len
    results = {}
    with SingleStream(setup, max_context) as stream:
        warmup = functools.partial(stream.latency, prompts[0][:32], 8)
        for prompt in prompts:
            results[len(prompt)], _ = median_metrics(
                functools.partial(stream.latency, prompt, args.output_len),
                args.repetitions,
                warmup=warmup,
            )
    return results


def measure_llama_bench(
    args: argparse.Namespace, tools: ToolRun, repetitions: int | None = None
) -> dict[int, Metrics]:
    """``llama-bench``'s figures per prompt length (the median of ``repetitions``, by default
    ``--repetitions``): TTFT from its prompt rate, decode at depth."""
    threads = physical_core_count()
    lengths = tuple(args.prompt_lens)
    build, model_file = tools.build, tools.model_file
    reps = args.repetitions if repetitions is None else repetitions
    prefill = [
        row
        for length in lengths
        for row in llama_bench(build, model_file, threads, reps, n_prompt=length)
    ]
    decode = llama_bench(build, model_file, threads, reps, n_gen=args.output_len, depths=lengths)
    prompt_rate = {row.n_prompt: row.tokens_per_s for row in prefill}
    decode_rate = {row.n_depth: row.tokens_per_s for row in decode}
    return {
        length: {"ttft_s": length / prompt_rate[length], "ms_per_token": 1000 / decode_rate[length]}
        for length in lengths
    }


def run(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.baselines import hf_baseline

    baselines = selected_baselines(args)
    # Checked before anything is measured: a missing llama-cpp-python or tool build is an error now.
    setup = prepare_llamacpp(args.model, args.llamacpp_weights) if LLAMACPP in baselines else None
    tools = (
        prepare_tool_run(args.model, args.llamacpp_weights) if LLAMA_BENCH in baselines else None
    )
    print(cpu_info().describe())
    if setup is not None:
        print(setup.describe())
    results: dict[str, dict[int, Metrics]] = {"hf_generate": {}}
    if tools is not None:
        print(tools.describe(LLAMA_BENCH))
    if tools is not None and not args.no_interleave:
        bench_runs: list[dict[int, Metrics]] = []
        turn = functools.partial(measure_llama_bench, args, tools, 1)
        results["kvserve"], prompts, source, dtype, pad_id, device = measure_kvserve(
            args, between=lambda: bench_runs.append(turn())
        )
        results[LLAMA_BENCH] = {
            length: median_of_runs([run[length] for run in bench_runs]) for length in bench_runs[0]
        }
        print(f"kvserve and {LLAMA_BENCH} took turns, one repetition each")
    else:
        results["kvserve"], prompts, source, dtype, pad_id, device = measure_kvserve(args)
        if tools is not None:
            results[LLAMA_BENCH] = measure_llama_bench(args, tools)
    gc.collect()
    warm = prompts[0][:32]
    if setup is not None:
        results[LLAMACPP] = in_own_process(measure_llamacpp, args, setup, prompts)
        gc.collect()
    if "generate" in baselines:
        hf_model = hf_baseline.load_hf_model(source, dtype, device)
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

    print(
        f"latency on {device}: batch 1, {args.output_len} output tokens, dtype {dtype}, "
        f"median of {args.repetitions}"
    )
    print(latency_table(results).render())
    if args.json:
        payload = {"args": vars(args) | {"run": None}, "results": results}
        if setup is not None:
            payload[LLAMACPP] = vars(setup)
        if tools is not None:
            payload[LLAMA_BENCH] = tools.as_json()
        write_json(args.json, "latency", payload)
    return 0


def latency_table(results: dict[str, dict[int, Metrics]]) -> Table:
    """Every system's row per prompt length; kvserve's carries its speed over each baseline's.

    A ratio is the baseline's time over kvserve's (above 1.00x kvserve is the
    faster): decode ms/token against every baseline that ran, and TTFT against
    ``llama-bench``, llama.cpp's own prefill figure.
    """
    references = []
    if results.get("hf_generate"):
        references.append(("decode vs HF", "hf_generate", "ms_per_token"))
    if LLAMA_BENCH in results:
        references += [
            ("decode vs llama-bench", LLAMA_BENCH, "ms_per_token"),
            ("TTFT vs llama-bench", LLAMA_BENCH, "ttft_s"),
        ]
    if LLAMACPP in results:
        references.append(("decode vs llama.cpp", LLAMACPP, "ms_per_token"))
    labels = [label for label, _, _ in references]
    table = Table(["prompt tokens", "system", "TTFT ms", "ms/token", "tok/s", *labels])
    for prompt_len, ours in results["kvserve"].items():
        speedups = []
        for _, reference, key in references:
            theirs = results.get(reference, {}).get(prompt_len)
            speedups.append(ratio(theirs[key], ours[key]) if theirs else "n/a")
        for name in ("kvserve", "hf_generate", LLAMA_BENCH, LLAMACPP):
            metrics = results.get(name, {}).get(prompt_len)
            if metrics is None:
                continue
            table.add(
                prompt_len,
                name,
                1000 * metrics["ttft_s"],
                metrics["ms_per_token"],
                1000 / metrics["ms_per_token"],
                *(speedups if name == "kvserve" else [""] * len(speedups)),
            )
    return table
