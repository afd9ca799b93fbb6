"""``kvserve bench sweep``: how throughput and per-stream speed trade off with concurrency.

For each maximum concurrency (``max_num_seqs``) 1, 2, 4, ... 64: a workload
of ``2 x concurrency`` requests (prompts of 128-512 tokens, 128 output
tokens) submitted at once. Reports output tok/s, mean ms per output token per
sequence, mean time to first token, peak memory, the FLOP/s of the steps that
decode a full batch with no prefill in them, the FLOP/s of all the model math,
and the fraction of the measured matmul roofline the largest batch reaches.

With ``--baselines llamacpp``, llama.cpp's batched decoding runs the same
requests at each concurrency (at most that many sequences at a time) and gets
a row of the same figures. With ``--baselines llama-batched-bench``, llama.cpp's
own tool runs as many sequences as each concurrency (prompts of the mean input
length, the same output length), and its S_TG (decode tok/s) stands beside
kvserve's decode tok/s, with kvserve's over it. Both baselines run the GGUF
file kvserve loaded, as stored, unless ``--llamacpp-weights bf16`` asks for a
BF16 copy.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
from typing import TYPE_CHECKING, Any

import torch

from kvserve.attention.flex_compile import COMPILE_STATS
from kvserve.benchmarks.baselines.llamacpp_baseline import (
    LLAMACPP,
    LlamaCppSetup,
    add_llamacpp_args,
    in_own_process,
    prepare_llamacpp,
)
from kvserve.benchmarks.baselines.llamacpp_tools import ToolRun, batched_bench, prepare_tool_run
from kvserve.benchmarks.common import (
    Metrics,
    Table,
    add_baselines_arg,
    add_common_args,
    cpu_info,
    median_metrics,
    ratio,
    selected_baselines,
    track_peak_rss,
    write_json,
)
from kvserve.benchmarks.offline.engine_driver import BenchRequest, drive
from kvserve.benchmarks.offline.roofline import (
    arithmetic_dtype,
    decode_step_floor_s,
    decode_step_flops_per_s,
    kv_read_bytes,
    measure_roofline,
    weight_bytes,
    workload_flops,
)
from kvserve.benchmarks.timings import DriveResult
from kvserve.benchmarks.workloads.prompts import prompts_of_lengths
from kvserve.engine import LLMEngine
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.errors import InvalidParameterError
from kvserve.kernels.tuning import describe_choice
from kvserve.models.arch_config import ArchConfig
from kvserve.trace.cli import open_trace
from kvserve.worker.model_runner import physical_core_count

BATCHED_BENCH = "llama-batched-bench"

if TYPE_CHECKING:
    from kvserve.benchmarks.baselines.llamacpp_batched import BatchedDecoder


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("sweep", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--input-len", type=int, nargs=2, default=(128, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument("--output-len", type=int, default=128)
    add_baselines_arg(parser, choices=(LLAMACPP, BATCHED_BENCH), default=())
    add_llamacpp_args(parser)
    add_common_args(parser)
    add_engine_args(parser, exclude=("max_num_seqs",))
    parser.set_defaults(run=run)


def point_metrics(
    result: DriveResult, arch: ArchConfig, concurrency: int, peak_rss: int, kv_dtype: torch.dtype
) -> Metrics:
    """One repetition's figures, the same for every system that fills a ``DriveResult``.

    The ``decode_step_*`` figures average the decode-only steps of a full batch: wall
    time, host time (the wall time less the host's wait for the device) and the K/V
    bytes they had to read (in ``kv_dtype``).
    """
    full = result.full_decode_steps(concurrency)
    count = len(full) or 1
    return {
        "output_tok_per_s": result.output_tokens() / result.wall_s,
        "ms_per_token_per_seq": result.mean_ms_per_token_per_seq(),
        "decode_tok_per_s": result.decode_tok_per_s(concurrency),
        "ttft_s": result.mean_ttft(),
        "peak_rss_gib": peak_rss / 1024**3,
        # Decode alone: the steps with no prefill in them that ran a full batch.
        "decode_step_gflops": decode_step_flops_per_s(arch, result.decode_steps, concurrency) / 1e9,
        "decode_step_ms": 1000 * sum(step.seconds for step in full) / count,
        "decode_step_host_ms": 1000 * sum(step.host_seconds for step in full) / count,
        "decode_step_kv_bytes": sum(kv_read_bytes(arch, s.context_lens, kv_dtype) for s in full)
        / count,
    }


def with_model_gflops(metrics: Metrics, arch: ArchConfig, requests: list[BenchRequest]) -> Metrics:
    """``metrics`` plus all the model math (prefills and decodes) over the wall time."""
    num_output = sum(r.output_len for r in requests)
    wall_s = num_output / metrics["output_tok_per_s"]
    work = workload_flops(
        arch, [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests]
    )
    return {**metrics, "model_gflops": work / wall_s / 1e9}


def sweep_point(engine: LLMEngine, requests: list[BenchRequest], concurrency: int) -> Metrics:
    engine.reset_prefix_cache()  # repetitions reuse the prompts; each must prefill them
    with track_peak_rss() as memory:
        result = drive(engine, requests)
    return point_metrics(
        result, engine.arch, concurrency, memory.peak_rss, engine.runner.kv_cache_dtype
    )


def llamacpp_point(
    decoder: BatchedDecoder, requests: list[BenchRequest], arch: ArchConfig, concurrency: int
) -> Metrics:
    prompts = [r.prompt_token_ids for r in requests]
    with track_peak_rss() as memory:
        result = decoder.run(prompts, [r.output_len for r in requests]).result
    # llama.cpp's KV cache is float16 by default.
    return point_metrics(result, arch, concurrency, memory.peak_rss, torch.float16)


def measure_llamacpp(
    setup: LlamaCppSetup,
    workloads: dict[int, list[BenchRequest]],
    arch: ArchConfig,
    repetitions: int,
) -> dict[int, Metrics]:
    """llama.cpp's medians at each concurrency, on kvserve's requests (batched decode)."""
    from kvserve.benchmarks.baselines.llamacpp_batched import BatchedDecoder

    results = {}
    for concurrency, requests in workloads.items():
        longest_prompt = max(len(r.prompt_token_ids) for r in requests)
        longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
        with BatchedDecoder(setup, concurrency, longest, longest_prompt) as decoder:
            metrics, _ = median_metrics(
                functools.partial(llamacpp_point, decoder, requests, arch, concurrency),
                repetitions,
                warmup=functools.partial(decoder.run, [requests[0].prompt_token_ids[:16]], [4]),
            )
        results[concurrency] = with_model_gflops(metrics, arch, requests)
    return results


def run(args: argparse.Namespace) -> int:
    baselines = selected_baselines(args)
    # Checked before anything is measured: a missing llama-cpp-python is an error now.
    setup = prepare_llamacpp(args.model, args.llamacpp_weights) if LLAMACPP in baselines else None
    if setup is not None:
        from kvserve.benchmarks.baselines.llamacpp_batched import max_parallel_sequences

        if max(args.concurrency) > max_parallel_sequences():
            raise InvalidParameterError(
                "concurrency",
                f"llama.cpp runs at most {max_parallel_sequences()} sequences at once, "
                f"got {max(args.concurrency)}",
            )
    tools = (
        prepare_tool_run(args.model, args.llamacpp_weights) if BATCHED_BENCH in baselines else None
    )
    print(cpu_info().describe())
    if setup is not None:
        print(setup.describe())
    model, engine_args = engine_kwargs(args)
    rng = random.Random(args.seed)
    results: dict[int, Metrics] = {}
    workloads: dict[int, list[BenchRequest]] = {}
    with open_trace(args.trace) as trace:
        for concurrency in args.concurrency:
            engine = LLMEngine.from_engine_args(model, max_num_seqs=concurrency, **engine_args)
            engine.set_trace(trace)
            lengths = [rng.randint(*args.input_len) for _ in range(2 * concurrency)]
            prompts = prompts_of_lengths(engine.tokenizer, lengths, args.seed + concurrency)
            requests = [BenchRequest(p, args.output_len) for p in prompts]
            metrics, _ = median_metrics(
                functools.partial(sweep_point, engine, requests, concurrency),
                args.repetitions,
                warmup=functools.partial(drive, engine, [BenchRequest(prompts[0][:16], 4)]),
            )
            results[concurrency] = with_model_gflops(metrics, engine.arch, requests)
            workloads[concurrency] = requests
            arch, dtype, weight_dtype = engine.arch, engine.runner.dtype, engine.runner.weight_dtype
            device = engine.runner.device
            precision = engine.runner.describe_precision()
            del engine
            gc.collect()
    llamacpp_results = (
        in_own_process(measure_llamacpp, setup, workloads, arch, args.repetitions)
        if setup is not None
        else {}
    )
    largest = max(args.concurrency)
    roof = measure_roofline(arch, largest, arithmetic_dtype(dtype, weight_dtype), device)
    for metrics in results.values():
        floor = decode_step_floor_s(
            arch, weight_dtype, metrics["decode_step_kv_bytes"], roof.memory_bytes_per_s
        )
        metrics["decode_step_floor_ms"] = 1000 * floor
    print(
        f"sweep on {device}: {args.output_len} output tokens, {precision}, "
        f"median of {args.repetitions}"
    )
    print(sweep_table(results, llamacpp_results).render())
    if (compiles := COMPILE_STATS.describe()) is not None:
        print(compiles)
    if (tuning := describe_choice()) is not None:
        print(tuning)
    tool_rates: dict[int, float] = {}
    if tools is not None:
        print(tools.describe(BATCHED_BENCH))
        tool_rates = measure_batched_bench(args, tools)
        print(batched_bench_table(results, tool_rates, args).render())
    top = results[largest]["decode_step_gflops"] * 1e9
    square = f"{roof.square_size}^3"
    print(
        f"roofline ({roof.dtype}, PyTorch matmul): {roof.matmul_flops / 1e9:.0f} GFLOP/s at {square}, "
        f"{roof.model_shape_flops / 1e9:.0f} GFLOP/s at ({largest} x {arch.hidden_size}) @ "
        f"({arch.hidden_size} x {2 * arch.intermediate_size}); for the record bf16 "
        f"{roof.bf16_matmul_flops / 1e9:.1f} GFLOP/s at {roof.bf16_size}^3 and fp32 "
        f"{roof.fp32_matmul_flops / 1e9:.1f} at {square}; memory {roof.memory_bytes_per_s / 1e9:.0f} GB/s"
    )
    print(
        "floor ms: a decode step's weight and K/V bytes over that memory bandwidth; host ms: "
        "its wall time less the host's wait for the device"
    )
    print(
        f"decode at concurrency {largest}: {top / 1e9:.0f} GFLOP/s = "
        f"{100 * top / roof.matmul_flops:.0f}% of the {square} {roof.dtype} matmul roofline, "
        f"{100 * top / roof.model_shape_flops:.0f}% of the model-shape one (the FLOPs of the "
        f"decode-only steps of {largest} rows, attention included, over their wall time)"
    )
    all_math = results[largest]["model_gflops"] * 1e9
    print(
        f"all model math at concurrency {largest}: {all_math / 1e9:.0f} GFLOP/s = "
        f"{100 * all_math / roof.matmul_flops:.0f}% of the {square} {roof.dtype} matmul roofline, "
        f"{100 * all_math / roof.model_shape_flops:.0f}% of the model-shape one"
    )
    single = results.get(1)
    if single is not None:
        bound = roof.memory_bytes_per_s / weight_bytes(arch, weight_dtype)
        print(
            f"single stream: {1000 / single['ms_per_token_per_seq']:.0f} tok/s; streaming the weights "
            f"once per token bounds it near {bound:.0f} tok/s"
        )
    if args.json:
        payload = {
            "args": vars(args) | {"run": None},
            "results": results,
            "roofline": vars(roof),
            "flex_compiles": vars(COMPILE_STATS),
        }
        if setup is not None:
            payload[LLAMACPP] = vars(setup) | {"results": llamacpp_results}
        if tools is not None:
            payload[BATCHED_BENCH] = tools.as_json() | {"s_tg": tool_rates}
        write_json(args.json, "sweep", payload)
    return 0


def sweep_table(results: dict[int, Metrics], llamacpp_results: dict[int, Metrics]) -> Table:
    """kvserve's row at each concurrency, then llama.cpp's, and the ratios of output tok/s
    (the whole workload) and of decode tok/s (the decode-only steps of a full batch)."""
    columns = [
        "concurrency",
        "system",
        "output tok/s",
        "ms/token/seq",
        "decode tok/s",
        "TTFT ms",
        "peak RSS GiB",
        "decode-step GFLOP/s",
        "model GFLOP/s",
        "step ms",
        "host ms",
        "floor ms",
    ]
    table = Table(columns + (["vs llama.cpp", "decode vs llama.cpp"] if llamacpp_results else []))
    for concurrency, ours in results.items():
        theirs = llamacpp_results.get(concurrency)
        rows = [("kvserve", ours)] + ([(LLAMACPP, theirs)] if theirs is not None else [])
        for name, metrics in rows:
            cells = [
                concurrency,
                name,
                metrics["output_tok_per_s"],
                metrics["ms_per_token_per_seq"],
                metrics["decode_tok_per_s"],
                1000 * metrics["ttft_s"],
                metrics["peak_rss_gib"],
                metrics["decode_step_gflops"],
                metrics["model_gflops"],
                metrics.get("decode_step_ms", "n/a"),
                metrics.get("decode_step_host_ms", "n/a"),
                metrics.get("decode_step_floor_ms", "n/a"),
            ]
            if llamacpp_results:
                for key in ("output_tok_per_s", "decode_tok_per_s"):
                    speedup = ratio(ours[key], theirs[key]) if theirs else "n/a"
                    cells.append(speedup if name == "kvserve" else "")
            table.add(*cells)
    return table


def measure_batched_bench(args: argparse.Namespace, tools: ToolRun) -> dict[int, float]:
    """``llama-batched-bench``'s S_TG at each concurrency, the median of the repetitions."""
    prompt_tokens = round(sum(args.input_len) / 2)
    runs = [
        batched_bench(
            tools.build,
            tools.model_file,
            physical_core_count(),
            prompt_tokens,
            args.output_len,
            tuple(args.concurrency),
        )
        for _ in range(args.repetitions)
    ]
    return {
        concurrency: statistics.median(
            row.decode_tokens_per_s for rows in runs for row in rows if row.sequences == concurrency
        )
        for concurrency in args.concurrency
    }


def batched_bench_table(
    results: dict[int, Metrics], tool_rates: dict[int, float], args: argparse.Namespace
) -> Table:
    """kvserve's decode tok/s (decode-only full-batch steps) beside llama-batched-bench's S_TG."""
    table = Table(["concurrency", "kvserve decode tok/s", "llama-batched-bench S_TG", "ratio"])
    for concurrency, ours in results.items():
        theirs = tool_rates.get(concurrency, 0.0)
        table.add(
            concurrency, ours["decode_tok_per_s"], theirs, ratio(ours["decode_tok_per_s"], theirs)
        )
    print(
        f"llama-batched-bench: -npp {round(sum(args.input_len) / 2)} -ntg {args.output_len} "
        f"-npl {','.join(map(str, args.concurrency))}, median of {args.repetitions}"
    )
    return table
