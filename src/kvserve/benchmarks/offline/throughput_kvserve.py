"""kvserve's side of the throughput benchmark: one engine, the whole workload at once.

``--data-parallel-size N`` measures N such engines instead (``data_parallel.py``,
which reuses ``kvserve_run``).
"""

from __future__ import annotations

import argparse
import functools
import time

from kvserve.attention.flex_compile import COMPILE_STATS
from kvserve.benchmarks.common import Metrics, median_metrics, track_peak_rss
from kvserve.benchmarks.offline.roofline import baseline_dtype
from kvserve.benchmarks.workloads.throughput import (
    Workload,
    make_workload,
    warmup_workload,
    with_rates,
)
from kvserve.entrypoints.args import engine_kwargs
from kvserve.kernels.tuning import describe_choice
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams
from kvserve.trace.cli import open_trace


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
        if (tuning := describe_choice()) is not None:
            print(tuning)
        workload = Workload(
            prompts,
            output_lens,
            engine.source,
            engine.arch,
            baseline_dtype(engine),
            llm.get_tokenizer().pad_token_id or 0,
            engine.runner.device,
        )
        return with_rates(medians, prompts, output_lens), workload
