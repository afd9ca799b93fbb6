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
import gc
from typing import Any

from kvserve.benchmarks.baselines.llamacpp_baseline import (
    LLAMACPP,
    add_llamacpp_args,
    in_own_process,
    prepare_llamacpp,
)
from kvserve.benchmarks.baselines.throughput_baselines import (
    measure_hf_continuous,
    measure_hf_static,
    measure_llamacpp,
)
from kvserve.benchmarks.common import (
    Metrics,
    add_baselines_arg,
    add_common_args,
    cpu_info,
    selected_baselines,
)
from kvserve.benchmarks.offline.throughput_kvserve import measure_kvserve
from kvserve.benchmarks.offline.throughput_report import print_summary, save_json
from kvserve.entrypoints.args import add_engine_args
from kvserve.errors import InvalidParameterError


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
        "--baseline-requests",
        type=int,
        metavar="N",
        help="run the baselines on the first N requests only (default: all): their rates "
        "then come from a sample of the same workload, for baselines too slow for all of it",
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


def run(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.baselines import hf_baseline
    from kvserve.benchmarks.offline.data_parallel import measure_data_parallel

    if args.data_parallel_size < 1:
        raise InvalidParameterError(
            "data_parallel_size", f"must be a positive integer, got {args.data_parallel_size}"
        )
    if args.baseline_requests is not None and args.baseline_requests < 1:
        raise InvalidParameterError(
            "baseline_requests", f"must be a positive integer, got {args.baseline_requests}"
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
    sample = workload.first(args.baseline_requests)
    if len(sample.prompts) < len(workload.prompts):
        notes.append(
            f"the baselines ran the first {len(sample.prompts)} of the {len(workload.prompts)} "
            "requests (--baseline-requests); their rates are over those"
        )
    if setup is not None:
        finished(LLAMACPP, in_own_process(measure_llamacpp, args, setup, sample))
        gc.collect()
    hf_model = (
        hf_baseline.load_hf_model(workload.source, workload.dtype, workload.device)
        if {"static", "continuous"} & set(baselines)
        else None
    )
    if hf_model is not None and "static" in baselines:
        finished("hf_static", measure_hf_static(args, hf_model, sample))
    if hf_model is not None and "continuous" in baselines:
        try:
            finished("hf_continuous", measure_hf_continuous(args, hf_model, sample))
        except Exception as exc:  # report why the baseline cannot run here, keep the rest
            notes.append(
                f"transformers continuous batching did not run: {type(exc).__name__}: {exc}"
            )
    print_summary(args, results, notes, workload)
    if args.json:
        save_json(args, results, notes, setup, complete=True)
    return 0
