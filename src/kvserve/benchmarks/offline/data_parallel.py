"""``kvserve bench throughput --data-parallel-size N``: N independent engines, one per process.

The workload's requests are dealt out round robin (request i to engine
``i % N``); each engine runs in its own process with its own KV cache and,
unless ``--num-threads`` says otherwise, one thread. All engines load and
warm up first, then start each repetition together (a barrier); a
repetition's wall time is the slowest engine's, its output tokens the sum
over the engines. This is data parallelism (replicas) on one host, the
alternative to splitting one engine's layers with ``--tensor-parallel-size``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
from multiprocessing.synchronize import Barrier
from typing import Any

import torch

from kvserve.benchmarks.common import Metrics
from kvserve.benchmarks.offline.roofline import baseline_dtype
from kvserve.benchmarks.offline.throughput_kvserve import kvserve_run
from kvserve.benchmarks.workloads.throughput import (
    Workload,
    make_workload,
    warmup_workload,
    with_rates,
)
from kvserve.entrypoints.args import engine_kwargs
from kvserve.llm import LLM
from kvserve.loader import load_arch_config, load_tokenizer, resolve_model

# Loading a model and warming it up, or one repetition, must end within this.
_PHASE_TIMEOUT_S = 3600.0


def _replica_main(
    index: int,
    model: str,
    engine_args: dict[str, Any],
    prompts: list[list[int]],
    output_lens: list[int],
    repetitions: int,
    barrier: Barrier,
    results: multiprocessing.Queue[tuple[int, Any]],
) -> None:
    """One engine: load, warm up, then per repetition wait for the others and run its share."""
    llm = LLM(model, **engine_args)
    kvserve_run(llm, *warmup_workload(prompts))
    engine = llm.llm_engine
    results.put((index, (engine.runner.describe_precision(), baseline_dtype(engine))))
    for _ in range(repetitions):
        barrier.wait(_PHASE_TIMEOUT_S)
        results.put((index, kvserve_run(llm, prompts, output_lens)))


def measure_data_parallel(args: argparse.Namespace) -> tuple[Metrics, Workload]:
    """The medians over repetitions of N engines serving the workload together."""
    model, engine_args = engine_kwargs(args)
    size = args.data_parallel_size
    engine_args = {**engine_args, "num_threads": engine_args.get("num_threads") or 1}
    source = resolve_model(model, engine_args.get("revision"))
    tokenizer = load_tokenizer(source)
    prompts, output_lens = make_workload(
        tokenizer, args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed
    )
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(size)
    results: multiprocessing.Queue[tuple[int, Any]] = context.Queue()
    processes = [
        context.Process(
            target=_replica_main,
            args=(
                index,
                model,
                engine_args,
                prompts[index::size],
                output_lens[index::size],
                args.repetitions,
                barrier,
                results,
            ),
            # Not daemonic: an engine with --tensor-parallel-size starts processes of its own.
            # The finally below ends them whatever happens.
            daemon=False,
        )
        for index in range(size)
    ]
    for process in processes:
        process.start()
    try:
        reports: dict[int, list[Any]] = {index: [] for index in range(size)}
        for _ in range(size * (args.repetitions + 1)):
            index, report = _next_result(results, processes)
            reports[index].append(report)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    precision, dtype = reports[0][0]
    runs: list[Metrics] = []
    for repetition in range(1, args.repetitions + 1):
        replicas: list[Metrics] = [reports[index][repetition] for index in range(size)]
        runs.append(
            {
                "wall_s": max(r["wall_s"] for r in replicas),
                "peak_rss_gib": sum(r["peak_rss_gib"] for r in replicas),
                "peak_kv_blocks": sum(r["peak_kv_blocks"] for r in replicas),
                "peak_kv_mib": sum(r["peak_kv_mib"] for r in replicas),
            }
        )
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(
        f"kvserve: {size} engines of {engine_args['num_threads']} thread(s) each, "
        f"{precision}; peak RSS and KV summed over the engines"
    )
    workload = Workload(
        prompts,
        output_lens,
        source,
        load_arch_config(source),
        dtype if isinstance(dtype, torch.dtype) else torch.float32,
        tokenizer.pad_token_id or 0,
    )
    return with_rates(medians, prompts, output_lens), workload


def _next_result(
    results: multiprocessing.Queue[tuple[int, Any]], processes: list[Any]
) -> tuple[int, Any]:
    """The next report of any engine; RuntimeError as soon as one exits early."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a data-parallel engine exited with code {failed[0]}") from None
