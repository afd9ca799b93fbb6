"""``kvserve demo prefix-cache``: requests that share a long system prompt, with prefix
caching off and on.

Requests arrive one after another, each once the previous one has finished,
and every one starts with the same long system prompt (a support assistant's
instructions and reference notes) followed by its own question. With prefix
caching on, the first request computes the shared blocks and every later one
takes them from the cache; its time to first token (TTFT) then covers only
its own question.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.benchmarks.workloads.text import passage
from kvserve.demos.context import DemoContext
from kvserve.demos.plotting import new_figure, save_png
from kvserve.demos.prompts import chat_token_ids
from kvserve.demos.result import DemoResult, Table
from kvserve.demos.step_log import StepLog, warm_up
from kvserve.engine import LLMEngine
from kvserve.sampling_params import SamplingParams

NAME = "prefix-cache"
TITLE = "Prefix caching computes a shared system prompt once"
MODES = {"off": False, "on": True}
QUESTIONS = (
    "Summarise the notes in one sentence.",
    "What is the main topic of the notes?",
    "Which people are mentioned in the notes?",
    "List three places that appear in the notes.",
    "Is there anything about the weather in the notes?",
    "What happened at the meeting?",
    "Give the notes a short title.",
    "Which sentence in the notes is the funniest?",
    "What would you ask the author of the notes?",
    "Translate the first sentence of the notes into French.",
    "How many different stories do the notes tell?",
    "What is the most surprising fact in the notes?",
)
INSTRUCTIONS = (
    "You are the help desk assistant of a small town library. Answer the visitor's question "
    "in one or two friendly sentences, using only the reference notes below. If the notes "
    "do not say, answer that you do not know.\n\nReference notes:\n"
)

EXPLANATION = (
    "{num_requests} requests arrive one after another (each once the previous one has "
    "finished). All start with the same system prompt, a help desk's instructions and "
    "reference notes (the prompts share their first {system_tokens} tokens), and end with "
    "their own question; each generates {max_tokens} tokens greedily. With "
    "`enable_prefix_caching` on, the engine keys every full KV block by a hash of the "
    "whole prefix up to it, so a later request finds the shared prompt's blocks already "
    "computed and prefills only the rest: the last, partly filled block and its question. "
    "The hit rate is the share of all prompt tokens taken from the cache ({hit_rate:.1f}% "
    "here; the first request finds nothing). TTFT runs from submission to the end of the "
    "step that produced the first token; each figure is the median of {repeats} runs per "
    "mode, each run starting from an empty cache. Mean TTFT of the requests after the "
    "first: {off_ms:.0f} ms without the cache, {on_ms:.0f} ms with it ({speedup:.1f}x). "
    "This is why kvserve keeps finished requests' full blocks in the pool (evicted least "
    "recently used) instead of discarding them: chat traffic repeats its system prompt on "
    "every turn."
)


@dataclass(frozen=True)
class Sizes:
    """num_requests: requests in the run; note_sentences: sentences of reference notes in
    the system prompt (its length); max_tokens: tokens each answer generates; repeats:
    runs per mode (TTFT is the median)."""

    num_requests: int = 8
    note_sentences: int = 40
    max_tokens: int = 16
    repeats: int = 3


def build_prompts(engine: LLMEngine, sizes: Sizes, seed: int) -> list[list[int]]:
    """The requests' prompts: the shared system prompt, then each one's question."""
    system_prompt = INSTRUCTIONS + passage(random.Random(seed), sizes.note_sentences)
    return [
        chat_token_ids(
            engine,
            [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]},
            ],
        )
        for index in range(sizes.num_requests)
    ]


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt that all of them share."""
    length = 0
    shortest = min(len(prompt) for prompt in prompts)
    while length < shortest and len({prompt[length] for prompt in prompts}) == 1:
        length += 1
    return length


def run(ctx: DemoContext) -> DemoResult:
    sizes = ctx.resolve_sizes(Sizes())
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(sizes.num_requests)]
    engines = {mode: ctx.engine(enable_prefix_caching=on) for mode, on in MODES.items()}
    prompts = build_prompts(engines["off"], sizes, ctx.seed)
    system_tokens = shared_prefix_length(prompts)
    for engine in engines.values():
        # The warm-up prompt shares no block with the workload (a different, short text).
        warm_up(engine, [prompts[0][-8:]])
    runs: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in MODES}
    # The modes alternate, so a busy moment on the machine slows both alike.
    for repeat in range(sizes.repeats):
        for mode, engine in engines.items():
            ctx.progress(f"  prefix caching {mode}, run {repeat + 1} of {sizes.repeats} ...")
            runs[mode].append(_arrive_one_by_one(engine, prompts, sizes.max_tokens, repeat))
    modes = {mode: _median_run(mode_runs) for mode, mode_runs in runs.items()}
    precision = engines["on"].runner.describe_precision()
    requests = []
    for index, question in enumerate(questions):
        off, on = modes["off"][index], modes["on"][index]
        requests.append(
            {
                "question": question,
                "prompt_tokens": on["prompt_tokens"],
                "cached_tokens": on["cached_tokens"],
                "ttft_off_s": off["ttft_s"],
                "ttft_on_s": on["ttft_s"],
                "speedup": off["ttft_s"] / on["ttft_s"],
            }
        )
    summary = {mode: _summary(results) for mode, results in modes.items()}
    data: dict[str, Any] = {
        "precision": precision,
        "num_requests": sizes.num_requests,
        "shared_prefix_tokens": system_tokens,
        "max_tokens": sizes.max_tokens,
        # The cache changes where K/V comes from, never what the model answers.
        "same_answers": all(
            off["answer_token_ids"] == on["answer_token_ids"]
            for off, on in zip(modes["off"], modes["on"], strict=True)
        ),
        "summary": summary,
        "requests": requests,
    }
    warm = (summary["off"]["mean_ttft_after_first_s"], summary["on"]["mean_ttft_after_first_s"])
    explanation = EXPLANATION.format(
        num_requests=sizes.num_requests,
        system_tokens=system_tokens,
        max_tokens=sizes.max_tokens,
        repeats=sizes.repeats,
        hit_rate=summary["on"]["hit_rate_percent"],
        off_ms=1000 * warm[0],
        on_ms=1000 * warm[1],
        speedup=warm[0] / warm[1],
    )
    return DemoResult(NAME, TITLE, explanation, tables(data), data, plot)


def _arrive_one_by_one(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, repeat: int
) -> list[dict[str, Any]]:
    """Run each prompt alone, in order, from an empty prefix cache; per request its TTFT
    and its prefix-cache hit."""
    kv = engine.kv_cache_manager
    engine.reset_prefix_cache()
    results = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        hits_before = kv.prefix_cache_hits
        log = StepLog(engine)
        request_id = f"run{repeat}-r{index}"
        log.submit(request_id, prompt, params)
        log.run()
        span = log.spans[request_id]
        results.append(
            {
                "prompt_tokens": len(prompt),
                "cached_tokens": kv.prefix_cache_hits - hits_before,
                "ttft_s": span.ttft_s,
                "answer_token_ids": span.output_token_ids,
            }
        )
    return results


def _median_run(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per request: the first run's hits and answer, and the median TTFT over the runs
    (each run starts from an empty cache, so only the timing varies)."""
    merged = []
    for per_run in zip(*runs, strict=True):
        first = dict(per_run[0])
        first["ttft_runs_s"] = [r["ttft_s"] for r in per_run]
        first["ttft_s"] = statistics.median(first["ttft_runs_s"])
        merged.append(first)
    return merged


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    later = results[1:] or results
    return {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate_percent": 100.0 * cached / prompt_tokens,
        "mean_ttft_s": sum(r["ttft_s"] for r in results) / len(results),
        "mean_ttft_after_first_s": sum(r["ttft_s"] for r in later) / len(later),
    }


def tables(data: Mapping[str, Any]) -> tuple[Table, ...]:
    per_request = Table.build(
        "Per request, in arrival order (TTFT in ms, median of the runs)",
        (
            "question",
            "prompt tokens",
            "tokens from cache",
            "TTFT off",
            "TTFT on",
            "speedup",
        ),
        [
            (
                r["question"],
                r["prompt_tokens"],
                r["cached_tokens"],
                1000 * r["ttft_off_s"],
                1000 * r["ttft_on_s"],
                r["speedup"],
            )
            for r in data["requests"]
        ],
    )
    summary = Table.build(
        "All requests",
        (
            "prefix caching",
            "prompt tokens",
            "tokens from cache",
            "hit rate %",
            "mean TTFT (ms)",
            "mean TTFT after the first (ms)",
        ),
        [
            (
                mode,
                s["prompt_tokens"],
                s["cached_tokens"],
                s["hit_rate_percent"],
                1000 * s["mean_ttft_s"],
                1000 * s["mean_ttft_after_first_s"],
            )
            for mode, s in data["summary"].items()
        ],
    )
    return per_request, summary


def plot(data: Mapping[str, Any], path: Path) -> None:
    figure, axes = new_figure(1, 2, width=11.0, height=4.6)
    requests = data["requests"]
    positions = list(range(1, len(requests) + 1))
    ttft, tokens = axes[0, 0], axes[0, 1]
    width = 0.4
    ttft.bar(
        [p - width / 2 for p in positions],
        [1000 * r["ttft_off_s"] for r in requests],
        width,
        color="tab:red",
        label="prefix caching off",
    )
    ttft.bar(
        [p + width / 2 for p in positions],
        [1000 * r["ttft_on_s"] for r in requests],
        width,
        color="tab:blue",
        label="prefix caching on",
    )
    ttft.set_xticks(positions)
    ttft.set_xlabel("request, in arrival order")
    ttft.set_ylabel("time to first token (ms)")
    ttft.set_title("TTFT per request")
    ttft.set_ylim(0, 1.25 * max(1000 * r["ttft_off_s"] for r in requests))
    ttft.legend(fontsize="small", loc="upper center", ncols=2)
    cached = [r["cached_tokens"] for r in requests]
    computed = [r["prompt_tokens"] - r["cached_tokens"] for r in requests]
    tokens.bar(positions, cached, color="tab:green", label="taken from the prefix cache")
    tokens.bar(positions, computed, bottom=cached, color="tab:grey", label="computed (prefill)")
    tokens.set_xticks(positions)
    tokens.set_xlabel("request, in arrival order")
    tokens.set_ylabel("prompt tokens")
    tokens.set_title(
        f"Prompt tokens with caching on: hit rate {data['summary']['on']['hit_rate_percent']:.1f}%"
    )
    tokens.set_ylim(0, 1.25 * max(r["prompt_tokens"] for r in requests))
    tokens.legend(fontsize="small", loc="upper center", ncols=2)
    figure.suptitle(
        f"{data['num_requests']} requests whose prompts share their first "
        f"{data['shared_prefix_tokens']} tokens (a long system prompt)"
    )
    save_png(figure, path)
