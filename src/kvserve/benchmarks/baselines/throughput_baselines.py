"""The throughput benchmark's baselines on kvserve's workload: transformers and llama.cpp.

Each returns its medians over ``--repetitions`` runs after a warm-up, with the
process's peak RSS and the rates of ``with_rates``, so every system's row
compares with kvserve's.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.benchmarks.baselines.llamacpp_baseline import LlamaCppSetup
from kvserve.benchmarks.common import Metrics, median_metrics, track_peak_rss
from kvserve.benchmarks.workloads.throughput import Workload, warmup_workload, with_rates

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def with_peak_rss(baseline: Callable[..., Metrics], *args: Any) -> Metrics:
    """``baseline(*args)``'s metrics with the process's peak RSS while it ran."""
    with track_peak_rss() as memory:
        metrics = baseline(*args)
    return {**metrics, "peak_rss_gib": memory.peak_rss / 1024**3}


def measure_llamacpp(args: argparse.Namespace, setup: LlamaCppSetup, workload: Workload) -> Metrics:
    """llama.cpp's medians on the same prompts and output lengths (batched decode)."""
    from kvserve.benchmarks.baselines.llamacpp_batched import (
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


def measure_hf_static(
    args: argparse.Namespace, hf_model: PreTrainedModel, workload: Workload
) -> Metrics:
    """transformers' static batching: batches of ``--hf-batch-size`` in arrival order."""
    from kvserve.benchmarks.baselines import hf_baseline

    prompts, output_lens, pad_id = workload.prompts, workload.output_lens, workload.pad_token_id
    warm = warmup_workload(prompts)
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
    return with_rates(medians, prompts, output_lens)


def measure_hf_continuous(
    args: argparse.Namespace, hf_model: PreTrainedModel, workload: Workload
) -> Metrics:
    """transformers' continuous batching manager on the whole workload."""
    from kvserve.benchmarks.baselines import hf_baseline

    prompts, output_lens = workload.prompts, workload.output_lens
    warm = warmup_workload(prompts)
    medians, _ = median_metrics(
        functools.partial(
            with_peak_rss, hf_baseline.continuous_batching, hf_model, prompts, output_lens
        ),
        args.repetitions,
        warmup=lambda: hf_baseline.continuous_batching(hf_model, *warm),
    )
    return with_rates(medians, prompts, output_lens)
