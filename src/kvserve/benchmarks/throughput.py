"""``kvserve bench throughput``: an offline batch, kvserve against transformers and llama.cpp.

Default workload: 128 requests, prompts of 64-512 tokens of English text,
outputs of 32-256 tokens (``ignore_eos``), all submitted at once. The same
prompts and lengths run through kvserve, transformers' static batching and
transformers' continuous batching (and, with ``--baselines llamacpp``,
llama.cpp's batched decoding), in one process, each after a warm-up, each
figure the median of the repetitions.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from kvserve.attention.flex_compile import COMPILE_STATS
from kvserve.benchmarks.common import (
    Metrics,
    Table,
    add_baselines_arg,
    cpu_info,
    median_metrics,
    ratio,
    selected_baselines,
    track_peak_rss,
    write_json,
)
from kvserve.benchmarks.corpus import prompts_of_lengths
from kvserve.benchmarks.llamacpp_baseline import (
    LLAMACPP,
    LlamaCppSetup,
    add_llamacpp_args,
    in_own_process,
    prepare_llamacpp,
)
from kvserve.benchmarks.roofline import baseline_dtype, workload_flops
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.errors import InvalidParameterError
from kvserve.llm import LLM
from kvserve.loader import ModelSource
from kvserve.models.arch_config import ArchConfig
from kvserve.sampling_params import SamplingParams
from kvserve.trace.cli import add_trace_arg, open_trace


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


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("throughput", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--hf-batch-size", type=int, default=32, help="static batch size of the baseline"
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="run N independent engines (processes, one thread each unless --num-threads), "
        "each on 1/N of the requests, and sum their output tokens over the slowest one's wall "
        "time; the baselines are not run then",
    )
    add_baselines_arg(
        parser, choices=("static", "continuous", LLAMACPP), default=("static", "continuous")
    )
    add_llamacpp_args(parser)
    add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(run=run)


def make_workload(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompt_lens = [rng.randint(*input_len) for _ in range(num_requests)]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return prompts_of_lengths(tokenizer, prompt_lens, seed), output_lens


def warmup_workload(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """A few of the prompts with short outputs: enough to load and warm each system."""
    few = prompts[:4]
    return few, [8] * len(few)


def kvserve_run(llm: LLM, prompts: list[list[int]], output_lens: list[int]) -> Metrics:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    engine = llm.llm_engine
    engine.reset_prefix_cache()  # repetitions reuse the prompts; each must prefill them
    engine.peak_num_blocks_used = 0
    with track_peak_rss() as memory:
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
    if [len(o.outputs[0].token_ids) for o in outputs] != output_lens:
        raise RuntimeError("kvserve did not produce the requested output lengths")
    return {
        "wall_s": wall,
        "peak_rss_gib": memory.peak_rss / 1024**3,
        "peak_kv_blocks": float(engine.peak_num_blocks_used),
        # A block's bytes depend on the model's KV cache groups (fewer layers per block
        # with sliding-window layers), so blocks alone do not compare across models.
        "peak_kv_mib": engine.peak_num_blocks_used * engine.runner.kv_bytes_per_block / 2**20,
    }


def with_peak_rss(baseline: Callable[..., Metrics], *args: Any) -> Metrics:
    """``baseline(*args)``'s metrics with the process's peak RSS while it ran."""
    with track_peak_rss() as memory:
        metrics = baseline(*args)
    return {**metrics, "peak_rss_gib": memory.peak_rss / 1024**3}


def with_rates(metrics: Metrics, prompts: list[list[int]], output_lens: list[int]) -> Metrics:
    num_output = sum(output_lens)
    num_total = num_output + sum(len(p) for p in prompts)
    wall = metrics["wall_s"]
    return {
        **metrics,
        "requests_per_s": len(prompts) / wall,
        "output_tok_per_s": num_output / wall,
        "total_tok_per_s": num_total / wall,
    }


@dataclass
class Workload:
    """The prompts and output lengths, and what the baselines need to load the same model."""

    prompts: list[list[int]]
    output_lens: list[int]
    source: ModelSource
    arch: ArchConfig
    dtype: torch.dtype
    pad_token_id: int


def measure_kvserve(args: argparse.Namespace) -> tuple[Metrics, Workload]:
    """kvserve's medians; the engine is gone when this returns, so its memory is too."""
    model, engine_args = engine_kwargs(args)
    with open_trace(args.trace) as trace:
        llm = LLM(model, **engine_args)
        llm.llm_engine.set_trace(trace)
        prompts, output_lens = make_workload(
            llm.get_tokenizer(),
            args.num_requests,
            tuple(args.input_len),
            tuple(args.output_len),
            args.seed,
        )
        medians, _ = median_metrics(
            functools.partial(kvserve_run, llm, prompts, output_lens),
            args.repetitions,
            warmup=functools.partial(kvserve_run, llm, *warmup_workload(prompts)),
        )
        engine = llm.llm_engine
        print(
            f"kvserve runs in {engine.runner.describe_precision()}; "
            f"transformers baselines in {baseline_dtype(engine)}"
        )
        if (compiles := COMPILE_STATS.describe()) is not None:
            print(compiles)
        workload = Workload(
            prompts,
            output_lens,
            engine.source,
            engine.arch,
            baseline_dtype(engine),
            llm.get_tokenizer().pad_token_id or 0,
        )
        return with_rates(medians, prompts, output_lens), workload


def measure_llamacpp(args: argparse.Namespace, setup: LlamaCppSetup, workload: Workload) -> Metrics:
    """llama.cpp's medians on the same prompts and output lengths (batched decode)."""
    from kvserve.benchmarks.llamacpp_batched import (
        BatchedDecoder,
        batched_wall_time,
        max_parallel_sequences,
    )

    prompts, output_lens = workload.prompts, workload.output_lens
    max_live = min(args.max_num_seqs, len(prompts), max_parallel_sequences())
    longest = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    with BatchedDecoder(setup, max_live, longest, max(len(p) for p in prompts)) as decoder:
        medians, _ = median_metrics(
            functools.partial(with_peak_rss, batched_wall_time, decoder, prompts, output_lens),
            args.repetitions,
            warmup=functools.partial(decoder.run, *warmup_workload(prompts)),
        )
    return with_rates(medians, prompts, output_lens)


def run(args: argparse.Namespace) -> int:
    from kvserve.benchmarks import hf_baseline
    from kvserve.benchmarks.data_parallel import measure_data_parallel

    if args.data_parallel_size < 1:
        raise InvalidParameterError(
            "data_parallel_size", f"must be a positive integer, got {args.data_parallel_size}"
        )
    data_parallel = args.data_parallel_size > 1
    baselines = () if data_parallel else selected_baselines(args)
    # Checked before anything is measured: a missing llama-cpp-python is an error now.
    setup = prepare_llamacpp(args.model, args.llamacpp_weights) if LLAMACPP in baselines else None
    print(cpu_info().describe())
    if setup is not None:
        print(setup.describe())
    results: dict[str, Metrics] = {}
    notes: list[str] = []

    def finished(name: str, metrics: Metrics) -> None:
        """Record one system's medians, print them and save what is known so far.

        A baseline can run for most of an hour on a small CPU; a run stopped
        before the end keeps the figures of every system that finished.
        """
        results[name] = metrics
        print(
            f"{name}: {metrics['output_tok_per_s']:.1f} output tok/s, "
            f"wall {metrics['wall_s']:.1f} s (median of {args.repetitions})",
            flush=True,
        )
        if args.json:
            save_json(args, results, notes, setup, complete=False)

    measure = measure_data_parallel if data_parallel else measure_kvserve
    kvserve_metrics, workload = measure(args)
    finished("kvserve", kvserve_metrics)
    gc.collect()
    prompts, output_lens, pad_id = workload.prompts, workload.output_lens, workload.pad_token_id
    warm = warmup_workload(prompts)
    if setup is not None:
        finished(LLAMACPP, in_own_process(measure_llamacpp, args, setup, workload))
        gc.collect()
    hf_model = (
        hf_baseline.load_hf_model(workload.source, workload.dtype)
        if {"static", "continuous"} & set(baselines)
        else None
    )
    if hf_model is not None and "static" in baselines:
        medians, _ = median_metrics(
            functools.partial(
                with_peak_rss,
                hf_baseline.static_batching,
                hf_model,
                prompts,
                output_lens,
                args.hf_batch_size,
                pad_id,
            ),
            args.repetitions,
            warmup=lambda: hf_baseline.static_batching(hf_model, *warm, len(warm[0]), pad_id),
        )
        finished("hf_static", with_rates(medians, prompts, output_lens))
    if hf_model is not None and "continuous" in baselines:
        try:
            medians, _ = median_metrics(
                functools.partial(
                    with_peak_rss, hf_baseline.continuous_batching, hf_model, prompts, output_lens
                ),
                args.repetitions,
                warmup=lambda: hf_baseline.continuous_batching(hf_model, *warm),
            )
            finished("hf_continuous", with_rates(medians, prompts, output_lens))
        except Exception as exc:  # report why the baseline cannot run here, keep the rest
            notes.append(
                f"transformers continuous batching did not run: {type(exc).__name__}: {exc}"
            )

    # Each system's output tok/s over each reference's; llama.cpp's column only when it ran.
    references = {"vs HF static": "hf_static"} | (
        {"vs llama.cpp": LLAMACPP} if LLAMACPP in results else {}
    )
    table = Table(
        ["system", "req/s", "output tok/s", "total tok/s", "wall s", "peak RSS GiB", *references]
    )
    for name, metrics in results.items():
        table.add(
            name,
            metrics["requests_per_s"],
            metrics["output_tok_per_s"],
            metrics["total_tok_per_s"],
            metrics["wall_s"],
            metrics.get("peak_rss_gib", 0.0),
            *(
                ratio(
                    metrics["output_tok_per_s"],
                    results.get(reference, {}).get("output_tok_per_s", 0.0),
                )
                for reference in references.values()
            ),
        )
    print(
        f"throughput: {len(prompts)} requests, prompts {args.input_len[0]}-{args.input_len[1]} "
        f"tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens, dtype {workload.dtype}, "
        f"{describe_processes(args)}, median of {args.repetitions}"
    )
    print(table.render())
    kv = results["kvserve"]
    work = workload_flops(workload.arch, [len(p) for p in prompts], output_lens)
    achieved = work / kv["wall_s"]
    print(
        f"kvserve peak KV blocks: {int(kv['peak_kv_blocks'])} ({kv['peak_kv_mib']:.1f} MiB); "
        f"~{achieved / 1e9:.1f} GFLOP/s of model math"
    )
    for note in notes:
        print(note)
    if args.json:
        save_json(args, results, notes, setup, complete=True)
    return 0


def describe_processes(args: argparse.Namespace) -> str:
    """How kvserve ran: e.g. ``2 threads``, ``2 ranks x 1 thread``, ``2 engines x 1 thread``."""
    threads = torch.get_num_threads()  # rank 0's runner set it for its process
    ranks = f"{args.tensor_parallel_size} tensor-parallel ranks x "
    if args.data_parallel_size > 1:
        ranks = f"{args.data_parallel_size} engines x " + (
            ranks if args.tensor_parallel_size > 1 else ""
        )
        return f"{ranks}{args.num_threads or 1} thread(s)"
    if args.tensor_parallel_size > 1:
        return f"{ranks}{threads} thread(s)"
    return f"{threads} threads"


def save_json(
    args: argparse.Namespace,
    results: dict[str, Metrics],
    notes: list[str],
    setup: LlamaCppSetup | None,
    *,
    complete: bool,
) -> None:
    """``complete`` is False while systems are still to run."""
    write_json(
        args.json,
        "throughput",
        {
            "args": vars(args) | {"run": None},
            "complete": complete,
            "results": results,
            "notes": notes,
            **({LLAMACPP: vars(setup)} if setup is not None else {}),
        },
    )
