"""``kvserve demo waste``: what a static batch spends on requests that already finished.

Four chat questions whose answers differ in length run as one batch of four.
A static batcher keeps every row of a batch until its longest member ends, so
each row that finished early is carried, as padding, for the rest of the
batch. The answer lengths and step counts are measured on the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.demos.context import DemoContext
from kvserve.demos.plotting import new_figure, save_png
from kvserve.demos.prompts import chat_token_ids
from kvserve.demos.questions import LONG, MEDIUM, SHORT, short_label
from kvserve.demos.result import DemoResult, Table
from kvserve.demos.step_log import StepLog, warm_up
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

NAME = "waste"
TITLE = "A static batch holds every slot until its longest answer ends"
QUESTIONS = (SHORT[0], SHORT[3], MEDIUM, LONG[0])

EXPLANATION = (
    "Four chat questions whose answers differ in length (greedy, EOS honoured, at most "
    "{max_tokens} tokens) run as one batch of four on kvserve, and the steps each request "
    "needed are measured. A static batcher, such as Hugging Face `generate()` on a padded "
    "batch, keeps every row until the longest member ends: a request that stopped early "
    "still occupies its slot, and the batch computes padding for it, for every remaining "
    "step. Those slot-steps are the waste below ({waste:.1f}% of the batch's slot-steps "
    "here). kvserve schedules per step instead (continuous batching): a finished request "
    "leaves the batch at once and its slot goes to the next waiting request "
    "(see static-vs-continuous)."
)


@dataclass(frozen=True)
class Sizes:
    """max_tokens: each answer's limit. max_tokens_each: per-question limits instead
    (tests use them to get different lengths from a random model, which rarely stops)."""

    max_tokens: int = 256
    max_tokens_each: tuple[int, ...] | None = None


def run(ctx: DemoContext) -> DemoResult:
    sizes = ctx.resolve_sizes(Sizes())
    limits = sizes.max_tokens_each or (sizes.max_tokens,) * len(QUESTIONS)
    if len(limits) != len(QUESTIONS):
        raise InvalidParameterError(
            "max_tokens_each", f"needs {len(QUESTIONS)} values, got {len(limits)}"
        )
    engine = ctx.engine(max_num_seqs=len(QUESTIONS), enable_prefix_caching=False)
    prompts = [chat_token_ids(engine, [{"role": "user", "content": q}]) for q in QUESTIONS]
    warm_up(engine, prompts)
    log = StepLog(engine)
    for index, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        log.submit(f"q{index}", prompt, SamplingParams(temperature=0, max_tokens=limit))
    log.run()
    batch_steps = len(log.steps)
    batch_end_s = log.steps[-1].end_s
    requests: list[dict[str, Any]] = []
    for question, span in zip(QUESTIONS, log.spans.values(), strict=True):
        done = span.to_json()
        requests.append(
            {
                "question": question,
                "answer_tokens": done["answer_tokens"],
                "finish_reason": done["finish_reason"],
                "steps_needed": span.num_steps,
                "finish_step": done["finish_step"],
                "steps_after_finish": batch_steps - done["finish_step"],
                "seconds_after_finish": batch_end_s - done["finish_s"],
            }
        )
    slot_steps = batch_steps * len(requests)
    wasted = sum(r["steps_after_finish"] for r in requests)
    data: dict[str, Any] = {
        "max_tokens": sizes.max_tokens,
        "precision": engine.runner.describe_precision(),
        "batch_steps": batch_steps,
        "num_slots": len(requests),
        "slot_steps": slot_steps,
        "wasted_steps": wasted,
        "waste_percent": 100.0 * wasted / slot_steps,
        "batch_seconds": batch_end_s,
        "requests": requests,
    }
    return DemoResult(
        NAME,
        TITLE,
        EXPLANATION.format(max_tokens=sizes.max_tokens, waste=data["waste_percent"]),
        tables(data),
        data,
        plot,
    )


def tables(data: Mapping[str, Any]) -> tuple[Table, ...]:
    per_request = Table.build(
        "Per request (one static batch of four)",
        (
            "question",
            "answer tokens",
            "finish",
            "steps needed",
            "steps held after finishing",
            "s held after finishing",
        ),
        [
            (
                r["question"],
                r["answer_tokens"],
                r["finish_reason"],
                r["steps_needed"],
                r["steps_after_finish"],
                r["seconds_after_finish"],
            )
            for r in data["requests"]
        ],
    )
    totals = Table.build(
        "The batch",
        ("batch steps", "slots", "slot-steps", "wasted slot-steps", "waste %", "batch time (s)"),
        [
            (
                data["batch_steps"],
                data["num_slots"],
                data["slot_steps"],
                data["wasted_steps"],
                data["waste_percent"],
                data["batch_seconds"],
            )
        ],
    )
    return per_request, totals


def plot(data: Mapping[str, Any], path: Path) -> None:
    figure, axes = new_figure(width=9.0, height=3.8)
    ax = axes[0, 0]
    requests = data["requests"]
    labels = [short_label(r["question"], 40) for r in requests]
    needed = [r["finish_step"] for r in requests]
    wasted = [r["steps_after_finish"] for r in requests]
    ax.barh(labels, needed, color="tab:blue", label="steps until its answer ended (useful)")
    ax.barh(
        labels,
        wasted,
        left=needed,
        color="lightgrey",
        hatch="//",
        edgecolor="grey",
        label="steps held after it finished (padding)",
    )
    ax.invert_yaxis()
    ax.set_xlabel("engine steps (one token per request per step)")
    ax.set_title(
        f"One static batch of {data['num_slots']}: {data['waste_percent']:.1f}% of slot-steps wasted"
    )
    figure.legend(loc="outside lower center", ncols=2, fontsize="small")
    save_png(figure, path)
