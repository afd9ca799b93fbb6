"""The throughput benchmark's results: the final table, the summary lines and the JSON file."""

from __future__ import annotations

import argparse

import torch

from kvserve.benchmarks.baselines.llamacpp_baseline import LLAMACPP, LlamaCppSetup
from kvserve.benchmarks.common import Metrics, Table, ratio, write_json
from kvserve.benchmarks.offline.roofline import workload_flops
from kvserve.benchmarks.workloads.throughput import Workload


def results_table(results: dict[str, Metrics]) -> Table:
    """A row per system, with its output tok/s over each reference's (llama.cpp's if it ran)."""
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
    return table


def print_summary(
    args: argparse.Namespace, results: dict[str, Metrics], notes: list[str], workload: Workload
) -> None:
    """The workload, the table, kvserve's KV cache peak and model FLOP/s, then the notes."""
    prompts, output_lens = workload.prompts, workload.output_lens
    print(
        f"throughput: {len(prompts)} requests, prompts {args.input_len[0]}-{args.input_len[1]} "
        f"tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens, dtype {workload.dtype}, "
        f"{describe_processes(args)}, median of {args.repetitions}"
    )
    print(results_table(results).render())
    kv = results["kvserve"]
    work = workload_flops(workload.arch, [len(p) for p in prompts], output_lens)
    achieved = work / kv["wall_s"]
    print(
        f"kvserve peak KV blocks: {int(kv['peak_kv_blocks'])} ({kv['peak_kv_mib']:.1f} MiB); "
        f"~{achieved / 1e9:.1f} GFLOP/s of model math"
    )
    for note in notes:
        print(note)


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
