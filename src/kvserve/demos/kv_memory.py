"""``kvserve demo kv-memory``: KV bytes held under three ways of allocating the cache.

For each concurrency, that many requests with a seeded, realistic mix of
prompt and answer lengths run together on kvserve. The tokens each request
holds in every step are recorded, and the same run is priced three ways: a
reservation of ``max_model_len`` tokens per request (what a cache of fixed
per-request tensors must hold), a contiguous per-request buffer that doubles
(copying) when full, and kvserve's paged cache, measured from the block pool.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.benchmarks.workloads.prompts import prompts_of_lengths
from kvserve.config import CacheConfig
from kvserve.demos.context import DemoContext
from kvserve.demos.plotting import MIB, new_figure, save_png
from kvserve.demos.result import DemoResult, Table
from kvserve.demos.step_log import StepLog
from kvserve.sampling_params import SamplingParams
from kvserve.worker.kv_pool import kv_cache_bytes_per_block

NAME = "kv-memory"
TITLE = "Paged KV blocks hold what the tokens need; reservations hold what they might need"
SCHEMES = ("static", "contiguous", "paged")
SCHEME_LABELS = {
    "needed": "bytes the tokens need",
    "static": "static reservation of max_model_len",
    "contiguous": "contiguous, grow by doubling",
    "paged": "kvserve paged blocks (measured)",
}

EXPLANATION = (
    "For each concurrency, that many requests run together on kvserve (`max_num_seqs` = "
    "the concurrency, prefix caching off), with prompt lengths drawn log-uniformly from "
    "{min_prompt}-{max_prompt} tokens and answer lengths from {min_output}-{max_output} "
    "tokens (seed {seed}). After every step the demo records how many tokens' K/V each "
    "request holds; *needed* is the peak over the run of their sum, at {bytes_per_token:,} "
    "bytes per token ({precision}). The same run is then priced two other ways: a *static "
    "reservation* of `max_model_len` = {max_model_len} tokens per running request (a cache of "
    "fixed per-request tensors), and a *contiguous* per-request buffer that starts at the "
    "prompt's length rounded up to a power of two and doubles, copying, when full (the "
    "moment of the copy, when both buffers exist, is not counted). The *paged* figure is "
    "measured: the engine's peak count of KV blocks in use times the bytes of a block "
    "({block_size} tokens). Waste is the share of a scheme's peak bytes that the needed "
    "peak does not fill. Paged blocks waste at most one partly filled block per request, "
    "which is why kvserve can hold many more requests in the same memory."
)


@dataclass(frozen=True)
class Sizes:
    """The concurrencies to run and the ranges the lengths are drawn from (log-uniform)."""

    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 512
    min_output_tokens: int = 16
    max_output_tokens: int = 192


def draw_lengths(sizes: Sizes, count: int, seed: int) -> list[tuple[int, int]]:
    """``count`` (prompt, output) lengths, log-uniform in the ranges: many short, a few long."""
    rng = random.Random(seed)

    def log_uniform(low: int, high: int) -> int:
        return round(math.exp(rng.uniform(math.log(low), math.log(high))))

    return [
        (
            log_uniform(sizes.min_prompt_tokens, sizes.max_prompt_tokens),
            log_uniform(sizes.min_output_tokens, sizes.max_output_tokens),
        )
        for _ in range(count)
    ]


def contiguous_capacity(num_prompt_tokens: int, num_tokens: int, max_model_len: int) -> int:
    """Tokens a doubling buffer holds room for: the prompt rounded up to a power of two,
    doubled until ``num_tokens`` fit (never past ``max_model_len``)."""
    capacity = 1 << max(0, num_prompt_tokens - 1).bit_length()
    while capacity < num_tokens:
        capacity *= 2
    return min(capacity, max_model_len)


def run(ctx: DemoContext) -> DemoResult:
    sizes = ctx.resolve_sizes(Sizes())
    lengths = draw_lengths(sizes, max(sizes.concurrencies), ctx.seed)
    levels = []
    facts: dict[str, Any] = {}
    for concurrency in sizes.concurrencies:
        ctx.progress(f"  {concurrency} concurrent requests ...")
        level, facts = _run_level(ctx, lengths[:concurrency])
        levels.append(level)
    data: dict[str, Any] = {
        **facts,
        "sizes": {
            "min_prompt_tokens": sizes.min_prompt_tokens,
            "max_prompt_tokens": sizes.max_prompt_tokens,
            "min_output_tokens": sizes.min_output_tokens,
            "max_output_tokens": sizes.max_output_tokens,
        },
        "seed": ctx.seed,
        "levels": levels,
    }
    explanation = EXPLANATION.format(
        min_prompt=sizes.min_prompt_tokens,
        max_prompt=sizes.max_prompt_tokens,
        min_output=sizes.min_output_tokens,
        max_output=sizes.max_output_tokens,
        seed=ctx.seed,
        **facts,
    )
    return DemoResult(NAME, TITLE, explanation, tables(data), data, plot)


def _run_level(
    ctx: DemoContext, lengths: list[tuple[int, int]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the requests together; their per-scheme peak bytes, and facts about the engine."""
    block_size = int(ctx.engine_args.get("block_size", CacheConfig.block_size))
    # Room for every request at its full length: the run never preempts.
    num_blocks = 1 + sum(-(-(prompt + output) // block_size) for prompt, output in lengths)
    engine = ctx.engine(
        max_num_seqs=len(lengths),
        enable_prefix_caching=False,
        num_blocks=num_blocks,
    )
    bytes_per_token = kv_cache_bytes_per_block(engine.arch, 1, engine.runner.kv_cache_dtype)
    prompts = prompts_of_lengths(engine.tokenizer, [p for p, _ in lengths], ctx.seed)
    log = StepLog(engine)
    for index, (prompt, (_, output)) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
        log.submit(f"r{index}", prompt, params)
    log.run()
    prompt_len = {rid: span.num_prompt_tokens for rid, span in log.spans.items()}
    max_model_len = engine.max_model_len
    peak_tokens = {"needed": 0, "static": 0, "contiguous": 0}
    for step in log.steps:
        held = step.tokens_held
        step_tokens = {
            "needed": sum(held.values()),
            "static": len(held) * max_model_len,
            "contiguous": sum(
                contiguous_capacity(prompt_len[rid], n, max_model_len) for rid, n in held.items()
            ),
        }
        for scheme, tokens in step_tokens.items():
            peak_tokens[scheme] = max(peak_tokens[scheme], tokens)
    peak_bytes = {scheme: tokens * bytes_per_token for scheme, tokens in peak_tokens.items()}
    peak_bytes["paged"] = engine.peak_num_blocks_used * engine.runner.kv_bytes_per_block
    waste = {
        scheme: 100.0 * (1.0 - peak_bytes["needed"] / peak_bytes[scheme]) for scheme in SCHEMES
    }
    level = {
        "concurrency": len(lengths),
        "engine_steps": len(log.steps),
        "prompt_tokens": sum(prompt_len.values()),
        "output_tokens": sum(len(span.output_token_ids) for span in log.spans.values()),
        "peak_blocks_used": engine.peak_num_blocks_used,
        "peak_bytes": peak_bytes,
        "waste_percent": waste,
    }
    facts = {
        "precision": engine.runner.describe_precision(),
        "max_model_len": max_model_len,
        "block_size": block_size,
        "bytes_per_token": bytes_per_token,
        "kv_bytes_per_block": engine.runner.kv_bytes_per_block,
    }
    return level, facts


def tables(data: Mapping[str, Any]) -> tuple[Table, ...]:
    rows = []
    for level in data["levels"]:
        peak, waste = level["peak_bytes"], level["waste_percent"]
        rows.append(
            (
                level["concurrency"],
                peak["needed"] / MIB,
                peak["static"] / MIB,
                waste["static"],
                peak["contiguous"] / MIB,
                waste["contiguous"],
                peak["paged"] / MIB,
                waste["paged"],
                level["peak_blocks_used"],
            )
        )
    return (
        Table.build(
            "Peak KV memory by concurrency (MiB; waste = share of the peak the tokens do not fill)",
            (
                "requests",
                "needed",
                "static",
                "static waste %",
                "contiguous",
                "contiguous waste %",
                "paged",
                "paged waste %",
                "peak blocks",
            ),
            rows,
        ),
    )


def plot(data: Mapping[str, Any], path: Path) -> None:
    figure, axes = new_figure(width=8.5, height=5.0)
    ax = axes[0, 0]
    levels = data["levels"]
    concurrency = [level["concurrency"] for level in levels]
    styles = {
        "static": dict(color="tab:red", marker="s"),
        "contiguous": dict(color="tab:orange", marker="^"),
        "paged": dict(color="tab:blue", marker="o"),
        "needed": dict(color="black", marker="", linestyle="--"),
    }
    largest = levels[-1]
    for scheme in (*SCHEMES, "needed"):
        values = [level["peak_bytes"][scheme] / MIB for level in levels]
        label = SCHEME_LABELS[scheme]
        if scheme in SCHEMES:
            waste = largest["waste_percent"][scheme]
            label += f": {waste:.1f}% waste at {largest['concurrency']}"
        ax.plot(concurrency, values, label=label, **styles[scheme])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("peak KV cache memory (MiB, log scale)")
    ax.set_title(
        f"KV memory held, max_model_len {data['max_model_len']}, "
        f"{data['bytes_per_token']:,} bytes per token"
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small")
    save_png(figure, path)
