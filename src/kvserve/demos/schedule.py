"""``kvserve demo schedule``: what the scheduler puts into each forward pass.

A few chat requests decode (the streams) while long prompts arrive. The same
workload runs twice: with chunked prefill, where a step holds every decode
plus at most a budget's worth of prompt chunks, and without, where a
prompt is computed whole in the step that admits it. The per-step view
(decode tokens, prefill chunks with their token ranges, budget used, blocks
used) comes from the engine's step trace, and so do the streams'
inter-token latencies.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Any

from kvserve.benchmarks.common import percentile
from kvserve.benchmarks.workloads.prompts import prompts_of_lengths
from kvserve.demos.context import DemoContext
from kvserve.demos.prompts import chat_token_ids
from kvserve.demos.questions import SHORT
from kvserve.demos.result import DemoResult
from kvserve.demos.schedule_view import plot, tables
from kvserve.engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.trace import StepRecord, TraceMemory

NAME = "schedule"
TITLE = "Chunked prefill keeps every step within a token budget, so streams keep flowing"
_WARM_UP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

EXPLANATION = (
    "{num_streams} chat requests generate {stream_tokens} tokens each (the streams) while "
    "{num_long} prompts of {long_len} tokens arrive (at steps {arrivals}). Each step is one "
    "forward pass over a flat batch: every stream's next token plus whatever prompt tokens "
    "the scheduler adds. With chunked prefill the step's budget is {budget} tokens, so a "
    "long prompt is split into chunks that ride along with the decodes over several steps; "
    "without it a prompt is computed whole in the step that admits it, and every stream "
    "waits for that whole step. Here a stream's typical gap between tokens was "
    "{p50_on:.0f} ms; its longest was {max_off:.0f} ms without chunks and {max_on:.0f} ms "
    "with them (medians of {repetitions} runs). Chunking spreads the same prompt work over "
    "more, shorter steps, so no stream stalls for a whole prompt."
)


@dataclass(frozen=True)
class Sizes:
    """num_streams, stream_tokens: the decoding requests and the tokens each generates.
    long_prompt_len, long_arrivals: the long prompts' length and the steps they arrive
    before. long_max_tokens: tokens each long prompt generates. chunk_budget:
    max_num_batched_tokens with chunked prefill. repetitions: runs of the workload per
    setting; times are the median of the runs."""

    num_streams: int = 4
    stream_tokens: int = 48
    long_prompt_len: int = 1024
    long_arrivals: tuple[int, ...] = (6, 18)
    long_max_tokens: int = 4
    chunk_budget: int = 256
    repetitions: int = 3


@dataclass(frozen=True)
class _Arrival:
    step: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def _engine(ctx: DemoContext, budget: int, chunked: bool) -> LLMEngine:
    return ctx.engine(
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        enable_prefix_caching=False,  # every run computes every prompt token
    )


def _workload(engine: LLMEngine, sizes: Sizes, seed: int) -> list[_Arrival]:
    """The streams at step 0, then the long prompts (English text) at their steps."""
    arrivals = []
    for index in range(sizes.num_streams):
        question = SHORT[index % len(SHORT)]
        prompt = chat_token_ids(engine, [{"role": "user", "content": question}])
        # Exactly stream_tokens each, so that both runs decode the same tokens.
        params = SamplingParams(temperature=0, max_tokens=sizes.stream_tokens, ignore_eos=True)
        arrivals.append(_Arrival(0, f"s{index}", prompt, params))
    lengths = [sizes.long_prompt_len] * len(sizes.long_arrivals)
    long_prompts = prompts_of_lengths(engine.tokenizer, lengths, seed)
    for index, (step, prompt) in enumerate(zip(sizes.long_arrivals, long_prompts, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=sizes.long_max_tokens, ignore_eos=True)
        arrivals.append(_Arrival(step, f"L{index}", prompt, params))
    return sorted(arrivals, key=lambda arrival: arrival.step)


def _run(engine: LLMEngine, arrivals: list[_Arrival], repetitions: int) -> list[list[StepRecord]]:
    """Run the workload ``repetitions`` times (each request added before its arrival step);
    the traced steps of each run."""
    # One short request first, untraced: the first steps of an engine pay one-time costs.
    engine.add_request("warm-up", {"prompt_token_ids": arrivals[0].prompt_token_ids}, _WARM_UP)
    while engine.has_unfinished_requests():
        engine.step()
    runs = []
    for _ in range(repetitions):
        trace = TraceMemory()
        engine.set_trace(trace)
        pending = list(arrivals)
        num_calls = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].step <= num_calls:
                arrival = pending.pop(0)
                prompt = {"prompt_token_ids": arrival.prompt_token_ids}
                engine.add_request(arrival.request_id, prompt, arrival.params)
            engine.step()
            num_calls += 1
        engine.set_trace(None)
        runs.append(trace.steps())
    return runs


def step_view(step: StepRecord) -> dict[str, Any]:
    """One step as the demo shows it: decode tokens, prompt chunks, tokens, blocks, time."""
    chunks: list[dict[str, Any]] = [
        {
            "id": e["id"],
            "start": e["start"],
            "end": e["start"] + e["tokens"],
            "partial": e["partial"],
        }
        for e in step["scheduled"]
        if e["phase"] != "decode"
    ]
    decode_tokens = sum(e["tokens"] for e in step["scheduled"] if e["phase"] == "decode")
    return {
        "step": step["step"],
        "ms": 1000 * (step["end_s"] - step["start_s"]),
        "decode_tokens": decode_tokens,
        "partial_chunk_tokens": sum(c["end"] - c["start"] for c in chunks if c["partial"]),
        "last_chunk_tokens": sum(c["end"] - c["start"] for c in chunks if not c["partial"]),
        "num_tokens": step["num_tokens"],
        "blocks_used": step["blocks_used"],
        "chunks": chunks,
    }


def stream_itls_ms(steps: list[StepRecord], stream_ids: list[str]) -> dict[str, list[float]]:
    """Per stream, the gaps between its consecutive tokens (a token is ready at the end of
    the step whose chunk for it was not partial)."""
    token_times: dict[str, list[float]] = {request_id: [] for request_id in stream_ids}
    for step in steps:
        for entry in step["scheduled"]:
            if entry["id"] in token_times and not entry["partial"]:
                token_times[entry["id"]].append(step["end_s"])
    return {
        request_id: [1000 * (b - a) for a, b in itertools.pairwise(times)]
        for request_id, times in token_times.items()
    }


def _measure(runs: list[list[StepRecord]], budget: int, stream_ids: list[str]) -> dict[str, Any]:
    """The per-step view of the runs (the same schedule each time) and the streams'
    inter-token latencies, each time the median over the runs: one run on a busy machine
    can stall at any step."""
    steps = runs[0]
    for other in runs[1:]:
        if [s["num_tokens"] for s in other] != [s["num_tokens"] for s in steps]:
            raise RuntimeError("the same workload was scheduled differently in two runs")
    views = [step_view(step) for step in steps]
    for index, view in enumerate(views):
        view["ms"] = statistics.median(
            1000 * (run[index]["end_s"] - run[index]["start_s"]) for run in runs
        )
    per_run = [stream_itls_ms(run, stream_ids) for run in runs]
    itls = {
        request_id: [
            statistics.median(gaps) for gaps in zip(*(r[request_id] for r in per_run), strict=True)
        ]
        for request_id in stream_ids
    }
    gaps = [gap for stream in itls.values() for gap in stream]
    return {
        "budget": budget,
        "repetitions": len(runs),
        "steps": views,
        "stream_itl_ms": itls,
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "itl_max_ms": max(gaps, default=0.0),
        "wall_s": statistics.median(run[-1]["end_s"] - run[0]["start_s"] for run in runs),
    }


def run(ctx: DemoContext) -> DemoResult:
    sizes = ctx.resolve_sizes(Sizes())
    ctx.progress("schedule: chunked prefill on")
    engine = _engine(ctx, sizes.chunk_budget, chunked=True)
    precision = engine.runner.describe_precision()
    arrivals = _workload(engine, sizes, ctx.seed)
    stream_ids = [a.request_id for a in arrivals if a.request_id.startswith("s")]
    runs = _run(engine, arrivals, sizes.repetitions)
    modes = {"chunked": _measure(runs, sizes.chunk_budget, stream_ids)}
    del engine  # one model in memory at a time
    ctx.progress("schedule: chunked prefill off")
    # Without chunks, a step must hold a whole request (prompt + output) beside the decodes.
    longest = max(len(a.prompt_token_ids) + a.params.max_tokens for a in arrivals)
    budget = max(longest, sizes.chunk_budget)
    runs = _run(_engine(ctx, budget, chunked=False), arrivals, sizes.repetitions)
    modes["unchunked"] = _measure(runs, budget, stream_ids)
    data: dict[str, Any] = {
        "precision": precision,
        "requests": [
            {
                "id": a.request_id,
                "arrival_step": a.step,
                "prompt_tokens": len(a.prompt_token_ids),
                "output_tokens": a.params.max_tokens,
            }
            for a in arrivals
        ],
        "modes": modes,
    }
    explanation = EXPLANATION.format(
        num_streams=sizes.num_streams,
        stream_tokens=sizes.stream_tokens,
        num_long=len(sizes.long_arrivals),
        long_len=sizes.long_prompt_len,
        arrivals=", ".join(str(step) for step in sizes.long_arrivals),
        budget=sizes.chunk_budget,
        p50_on=modes["chunked"]["itl_p50_ms"],
        max_on=modes["chunked"]["itl_max_ms"],
        max_off=modes["unchunked"]["itl_max_ms"],
        repetitions=sizes.repetitions,
    )
    return DemoResult(NAME, TITLE, explanation, tables(data), data, plot)
