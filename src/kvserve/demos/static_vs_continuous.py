"""``kvserve demo static-vs-continuous``: one queue, two batching policies.

Eight chat questions wait in a queue, four with short answers and four with
long ones, and at most four run at once. Static batching starts the next four
only when the whole batch is done; continuous batching gives a finished
request's seat to the next waiting one in the following step. Both use the
same engine and settings; only the policy differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.demos.context import DemoContext
from kvserve.demos.plotting import new_figure, save_png
from kvserve.demos.prompts import chat_token_ids
from kvserve.demos.questions import LONG, SHORT, short_label
from kvserve.demos.result import DemoResult, Table
from kvserve.demos.step_log import StepLog, warm_up
from kvserve.engine import LLMEngine
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

NAME = "static-vs-continuous"
TITLE = "Static batching waits for the slowest request; continuous batching refills at once"
# Short and long answers alternate, so every static batch holds long ones.
QUEUE = (LONG[0], SHORT[0], SHORT[1], LONG[1], SHORT[2], LONG[2], SHORT[3], LONG[3])
KINDS = ("long", "short", "short", "long", "short", "long", "short", "long")
POLICIES = ("static", "continuous")

EXPLANATION = (
    "Eight chat questions wait in one queue: four with short answers and four with long "
    "ones (greedy, EOS honoured, at most {max_tokens} tokens), and at most {max_running} "
    "run at once. *Static batching* is driven by the demo: it submits four questions to "
    "the engine and submits the next four only when all of them have finished, as a "
    "batcher with a fixed batch must. (On kvserve a finished request's row is no longer "
    "computed, so this baseline is kinder than a padded batcher, which goes on computing "
    "it.) *Continuous batching* is kvserve's own scheduler (`max_num_seqs={max_running}`) "
    "with the whole queue submitted at once: when a request ends, the next step admits a "
    "waiting one, whose prompt is computed in the same forward pass as the others' next "
    "tokens. Each policy ran {repeats} times, alternating; the run with the median wall "
    "time is shown. {same} The queue took {static_steps} engine steps and {static_s:.1f} s "
    "under static batching and {continuous_steps} steps and {continuous_s:.1f} s under "
    "continuous batching ({speedup:.2f}x faster); the short questions queued behind a long "
    "batch gain the most. This is why kvserve schedules per step and keeps no phase for a "
    "batch: a seat is never held by a finished request."
)


@dataclass(frozen=True)
class Sizes:
    """max_tokens: each answer's limit; max_running: seats (max_num_seqs);
    max_tokens_each: per-question limits instead of max_tokens (tests use them to get
    different lengths from a random model, which rarely stops); repeats: runs of each
    policy (the one with the median wall time is reported)."""

    max_tokens: int = 256
    max_running: int = 4
    max_tokens_each: tuple[int, ...] | None = None
    repeats: int = 3


def run(ctx: DemoContext) -> DemoResult:
    sizes = ctx.resolve_sizes(Sizes())
    limits = sizes.max_tokens_each or (sizes.max_tokens,) * len(QUEUE)
    if len(limits) != len(QUEUE):
        raise InvalidParameterError(
            "max_tokens_each", f"needs {len(QUEUE)} values, got {len(limits)}"
        )
    engine = ctx.engine(max_num_seqs=sizes.max_running, enable_prefix_caching=False)
    prompts = [chat_token_ids(engine, [{"role": "user", "content": q}]) for q in QUEUE]
    params = [SamplingParams(temperature=0, max_tokens=limit) for limit in limits]
    warm_up(engine, prompts[: sizes.max_running])
    all_runs: dict[str, list[StepLog]] = {policy: [] for policy in POLICIES}
    # The policies alternate, so a busy moment on the machine slows both alike.
    for repeat in range(sizes.repeats):
        ctx.progress(f"  static and continuous batching, run {repeat + 1} of {sizes.repeats} ...")
        all_runs["static"].append(_static(engine, prompts, params, sizes.max_running))
        all_runs["continuous"].append(_continuous(engine, prompts, params))
    runs = {policy: _median_run(logs) for policy, logs in all_runs.items()}
    static = runs["static"]
    requests = []
    for index, (question, kind) in enumerate(zip(QUEUE, KINDS, strict=True)):
        entry: dict[str, Any] = {"question": question, "kind": kind}
        for policy, log in runs.items():
            entry[policy] = log.spans[f"q{index}"].to_json()
        entry["speedup"] = entry["static"]["latency_s"] / entry["continuous"]["latency_s"]
        requests.append(entry)
    totals = {policy: _totals(log) for policy, log in runs.items()}
    for policy, logs in all_runs.items():
        totals[policy]["wall_s_runs"] = [log.steps[-1].end_s for log in logs]
    data: dict[str, Any] = {
        "max_tokens": sizes.max_tokens,
        "max_running": sizes.max_running,
        "repeats": sizes.repeats,
        "precision": engine.runner.describe_precision(),
        # Requests whose answer is the same, token for token, in every run of either policy.
        "num_same_answers": sum(
            all(
                log.spans[rid].output_token_ids == static.spans[rid].output_token_ids
                for logs in all_runs.values()
                for log in logs
            )
            for rid in static.spans
        ),
        "totals": totals,
        "speedup": totals["static"]["wall_s"] / totals["continuous"]["wall_s"],
        "requests": requests,
    }
    explanation = EXPLANATION.format(
        same=_same_answers_sentence(data["num_same_answers"], len(QUEUE), data["precision"]),
        max_tokens=sizes.max_tokens,
        max_running=sizes.max_running,
        repeats=sizes.repeats,
        static_steps=totals["static"]["engine_steps"],
        static_s=totals["static"]["wall_s"],
        continuous_steps=totals["continuous"]["engine_steps"],
        continuous_s=totals["continuous"]["wall_s"],
        speedup=data["speedup"],
    )
    return DemoResult(NAME, TITLE, explanation, tables(data), data, plot)


def _static(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], seats: int
) -> StepLog:
    """Batches of ``seats`` requests, each submitted when the previous one has finished."""
    log = StepLog(engine)
    for start in range(0, len(prompts), seats):
        for index in range(start, min(start + seats, len(prompts))):
            # Every request has been in the queue since time zero.
            log.submit(f"q{index}", prompts[index], params[index], queued_s=0.0)
        log.run()
    return log


def _continuous(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> StepLog:
    """The whole queue submitted at once; the scheduler refills seats as requests end."""
    log = StepLog(engine)
    for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        log.submit(f"q{index}", prompt, request_params)
    log.run()
    return log


def _same_answers_sentence(num_same: int, num_requests: int, precision: str) -> str:
    if num_same == num_requests:
        return "Every answer is the same, token for token, under both policies."
    return (
        f"{num_same} of the {num_requests} answers are the same, token for token, under both "
        f"policies: with {precision}, a request's arithmetic can round differently in "
        "a different batch, and where two tokens nearly tie, the greedy choice can flip "
        "(in float32 every answer is the same)."
    )


def _median_run(logs: list[StepLog]) -> StepLog:
    """The run with the median wall time (the step counts of every run are the same)."""
    return sorted(logs, key=lambda log: log.steps[-1].end_s)[len(logs) // 2]


def _totals(log: StepLog) -> dict[str, Any]:
    spans = list(log.spans.values())
    wall_s = log.steps[-1].end_s
    generated = sum(len(span.output_token_ids) for span in spans)
    return {
        "engine_steps": len(log.steps),
        "wall_s": wall_s,
        "mean_latency_s": sum(span.latency_s for span in spans) / len(spans),
        "generated_tokens": generated,
        "tokens_per_s": generated / wall_s,
    }


def tables(data: Mapping[str, Any]) -> tuple[Table, ...]:
    per_request = Table.build(
        "Per request (latency from joining the queue; steps counted from the queue's start)",
        (
            "question",
            "answer",
            "tokens (static)",
            "finish step (static)",
            "latency s (static)",
            "tokens (continuous)",
            "finish step (continuous)",
            "latency s (continuous)",
            "speedup",
        ),
        [
            (
                short_label(r["question"], 40),
                r["kind"],
                r["static"]["answer_tokens"],
                r["static"]["finish_step"],
                r["static"]["latency_s"],
                r["continuous"]["answer_tokens"],
                r["continuous"]["finish_step"],
                r["continuous"]["latency_s"],
                r["speedup"],
            )
            for r in data["requests"]
        ],
    )
    totals = Table.build(
        "The whole queue",
        ("policy", "engine steps", "wall time (s)", "mean latency (s)", "tokens", "tokens/s"),
        [
            (
                policy,
                t["engine_steps"],
                t["wall_s"],
                t["mean_latency_s"],
                t["generated_tokens"],
                t["tokens_per_s"],
            )
            for policy, t in data["totals"].items()
        ],
    )
    return per_request, totals


_COLORS = {"short": "tab:orange", "long": "tab:blue"}


def plot(data: Mapping[str, Any], path: Path) -> None:
    """A Gantt chart per policy: each request's wait in the queue and its run, in seconds."""
    figure, axes = new_figure(2, 1, width=9.5, height=6.4, sharex=True)
    requests = data["requests"]
    labels = [f"{short_label(r['question'], 30)} ({r['kind']})" for r in requests]
    for ax, policy in zip(axes[:, 0], POLICIES, strict=True):
        for row, request in enumerate(requests):
            span = request[policy]
            waited = span["first_s"] - span["submit_s"]
            ax.barh(
                row, waited, left=span["submit_s"], color="lightgrey", label="waiting in the queue"
            )
            ax.barh(
                row,
                span["finish_s"] - span["first_s"],
                left=span["first_s"],
                color=_COLORS[request["kind"]],
                label=f"running ({request['kind']} answer)",
            )
        totals = data["totals"][policy]
        ax.axvline(totals["wall_s"], color="black", linestyle="--", linewidth=1, label="queue done")
        ax.set_xlim(left=0)
        ax.set_yticks(range(len(labels)), labels, fontsize="small")
        ax.invert_yaxis()
        ax.set_title(
            f"{policy} batching: {totals['engine_steps']} engine steps, {totals['wall_s']:.2f} s"
        )
    axes[1, 0].set_xlabel("time since the queue started (s)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    figure.legend(
        unique.values(), unique.keys(), loc="outside lower center", ncols=4, fontsize="small"
    )
    figure.suptitle(
        f"{len(requests)} requests, at most {data['max_running']} at once: "
        f"continuous batching {data['speedup']:.2f}x faster"
    )
    save_png(figure, path)
