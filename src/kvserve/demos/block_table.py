"""``kvserve demo block-table``: a request's KV blocks, logical and physical.

One chat request runs alone through prefill and decode; its block table is
printed after the prefill and at every step that gave it a new block. Then
four requests arrive a few steps apart and decode together: each one's
table is contiguous (logical block i holds tokens ``i * block_size`` to
``(i + 1) * block_size - 1``), but the physical blocks they point to are
interleaved in the pool, in the order the steps asked for them. The tables
are read from the engine's KV cache manager; the blocks in use are checked
against the step trace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.patches import Rectangle

from kvserve.core.request import Request
from kvserve.demos.context import DemoContext
from kvserve.demos.plotting import new_figure, save_png
from kvserve.demos.prompts import chat_token_ids
from kvserve.demos.questions import LONG
from kvserve.demos.result import DemoResult, Table
from kvserve.engine import LLMEngine
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams
from kvserve.trace import StepRecord, TraceMemory

NAME = "block-table"
TITLE = "Block tables: contiguous for the request, scattered in the pool"
SOLO_QUESTION = LONG[1]
INTERLEAVED_QUESTIONS = (LONG[0], LONG[2], LONG[3], LONG[1])
COLUMNS = ("logical block", "physical block", "first token", "last token", "tokens in block")

EXPLANATION = (
    "The paged KV cache splits every request's keys and values into blocks of {block_size} "
    "tokens. A request's block table maps its logical blocks (token positions 0-{last}, "
    "{block_size}-{next_last}, ...) to physical blocks of the shared pool; a new block is "
    "taken from the front of the pool's free queue only when the last one is full, so a "
    "request never holds more than one partly filled block. Alone, a request's blocks happen "
    "to be consecutive. Four requests decoding together ask for blocks in turn, so their "
    "physical blocks interleave: request memory need not be contiguous, nothing is reserved "
    "ahead, and a finished request's blocks can serve any other request. Block 0 is the null "
    "block, never handed out."
)


@dataclass(frozen=True)
class Sizes:
    """block_size: tokens per KV block. solo_max_tokens: the lone request's answer limit.
    max_tokens_each: the four interleaved requests' limits. arrival_every: steps between
    their arrivals."""

    block_size: int = 16
    solo_max_tokens: int = 40
    max_tokens_each: tuple[int, ...] = (48, 64, 40, 56)
    arrival_every: int = 2


def block_rows(block_ids: Sequence[int], num_tokens: int, block_size: int) -> list[list[int]]:
    """One row per logical block: logical, physical, first and last token, tokens held."""
    rows = []
    for logical, physical in enumerate(block_ids):
        first = logical * block_size
        last = min(first + block_size, num_tokens) - 1
        rows.append([logical, physical, first, last, last - first + 1])
    return rows


def _table_of(engine: LLMEngine, request: Request) -> list[list[int]]:
    (block_ids,) = engine.kv_cache_manager.get_block_ids(request.request_id)
    return block_rows(block_ids, request.num_computed_tokens, engine.kv_cache_manager.block_size)


def _solo(engine: LLMEngine, sizes: Sizes, trace: TraceMemory) -> dict[str, Any]:
    """The lone request: a snapshot of its table after prefill and after each new block."""
    prompt = chat_token_ids(engine, [{"role": "user", "content": SOLO_QUESTION}])
    params = SamplingParams(temperature=0, max_tokens=sizes.solo_max_tokens)
    engine.add_request("solo", {"prompt_token_ids": prompt}, params)
    request = engine.scheduler.requests["solo"]
    snapshots: list[dict[str, Any]] = []
    step = -1
    while not request.is_finished:
        engine.step()
        step += 1
        if request.is_finished:
            break  # its blocks are back in the pool already
        table = _table_of(engine, request)
        if not snapshots or len(table) > len(snapshots[-1]["table"]):
            snapshots.append(
                {
                    "step": step,
                    "event": "prefill" if not snapshots else "new block",
                    "computed_tokens": request.num_computed_tokens,
                    "output_tokens": request.num_output_tokens,
                    "blocks_used_in_pool": _last_step(trace)["blocks_used"],
                    "table": table,
                }
            )
    return {
        "question": SOLO_QUESTION,
        "prompt_tokens": len(prompt),
        "output_tokens": request.num_output_tokens,
        "finish_reason": request.status.finish_reason,
        "finish_step": step,
        "blocks_at_finish": _last_step(trace)["blocks_used"],
        "snapshots": snapshots,
    }


def _last_step(trace: TraceMemory) -> StepRecord:
    """The step just run (the demo's engine always has work, so every step is recorded)."""
    record = trace.records[-1]
    assert record["kind"] == "step"
    return record


def _interleaved(engine: LLMEngine, sizes: Sizes, trace: TraceMemory) -> dict[str, Any]:
    """Four requests arriving ``arrival_every`` steps apart; their tables at the last step
    all four were running."""
    if len(sizes.max_tokens_each) != len(INTERLEAVED_QUESTIONS):
        raise InvalidParameterError(
            "max_tokens_each",
            f"needs {len(INTERLEAVED_QUESTIONS)} values, got {len(sizes.max_tokens_each)}",
        )
    pending = []
    for index, (question, limit) in enumerate(
        zip(INTERLEAVED_QUESTIONS, sizes.max_tokens_each, strict=True)
    ):
        prompt = chat_token_ids(engine, [{"role": "user", "content": question}])
        params = SamplingParams(temperature=0, max_tokens=limit)
        pending.append((f"r{index}", index * sizes.arrival_every, question, prompt, params))
    requests: dict[str, Request] = {}
    arrivals: list[dict[str, Any]] = []
    snapshot: dict[str, Any] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1] <= step:
            request_id, arrival_step, question, prompt, params = pending.pop(0)
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            requests[request_id] = engine.scheduler.requests[request_id]
            arrivals.append(
                {
                    "id": request_id,
                    "question": question,
                    "arrival_step": arrival_step,
                    "prompt_tokens": len(prompt),
                }
            )
        engine.step()
        running = [r for r in requests.values() if r.num_computed_tokens and not r.is_finished]
        if len(running) == len(INTERLEAVED_QUESTIONS):
            snapshot = {
                "step": step,
                "blocks_used_in_pool": _last_step(trace)["blocks_used"],
                "tables": {r.request_id: _table_of(engine, r) for r in running},
                "computed_tokens": {r.request_id: r.num_computed_tokens for r in running},
            }
        step += 1
    for arrival in arrivals:
        arrival["output_tokens"] = requests[arrival["id"]].num_output_tokens
    return {"requests": arrivals, "snapshot": snapshot}


def run(ctx: DemoContext) -> DemoResult:
    sizes = ctx.resolve_sizes(Sizes())
    # Without prefix caching every block has one owner, which is what the picture shows.
    engine = ctx.engine(block_size=sizes.block_size, enable_prefix_caching=False, max_num_seqs=4)
    trace = TraceMemory()
    engine.set_trace(trace)
    ctx.progress("block-table: one request alone")
    solo = _solo(engine, sizes, trace)
    ctx.progress("block-table: four interleaved requests")
    interleaved = _interleaved(engine, sizes, trace)
    engine.set_trace(None)
    data: dict[str, Any] = {
        "block_size": sizes.block_size,
        "num_blocks": engine.kv_cache_manager.num_usable_blocks,
        "precision": engine.runner.describe_precision(),
        "solo": solo,
        "interleaved": interleaved,
    }
    block_size = sizes.block_size
    explanation = EXPLANATION.format(
        block_size=block_size, last=block_size - 1, next_last=2 * block_size - 1
    )
    return DemoResult(NAME, TITLE, explanation, tables(data), data, plot)


def tables(data: Mapping[str, Any]) -> tuple[Table, ...]:
    solo = data["solo"]
    solo_rows = [
        (snapshot["step"], snapshot["event"], snapshot["computed_tokens"], *row)
        for snapshot in solo["snapshots"]
        for row in snapshot["table"]
    ]
    solo_table = Table.build(
        f"One request ({solo['prompt_tokens']} prompt tokens, {solo['output_tokens']} generated): "
        f"its block table after the prefill and at each new block",
        ("step", "event", "tokens with K/V", *COLUMNS),
        solo_rows,
    )
    snapshot = data["interleaved"]["snapshot"]
    interleaved_rows = [
        (request_id, *row)
        for request_id, table in snapshot.get("tables", {}).items()
        for row in table
    ]
    interleaved_table = Table.build(
        f"Four interleaved requests: their block tables at step {snapshot.get('step', '-')}",
        ("request", *COLUMNS),
        interleaved_rows,
    )
    requests_table = Table.build(
        "The four requests",
        ("request", "question", "arrives at step", "prompt tokens", "generated tokens"),
        [
            (r["id"], r["question"], r["arrival_step"], r["prompt_tokens"], r["output_tokens"])
            for r in data["interleaved"]["requests"]
        ],
    )
    return solo_table, requests_table, interleaved_table


def plot(data: Mapping[str, Any], path: Path) -> None:
    """The pool (physical blocks coloured by owner) beside the four logical tables."""
    snapshot = data["interleaved"]["snapshot"]
    tables_by_request: dict[str, list[list[int]]] = snapshot.get("tables", {})
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    owner = {
        row[1]: (index, row)
        for index, table in enumerate(tables_by_request.values())
        for row in table
    }
    block_size = data["block_size"]
    figure, axes = new_figure(1, 2, width=11.0, height=4.6)
    pool_ax, table_ax = axes[0]
    highest = max(owner, default=1)
    per_row = 8
    for block_id in range(1, highest + 1):
        x, y = (block_id - 1) % per_row, (block_id - 1) // per_row
        index, row = owner.get(block_id, (None, None))
        color = "lightgrey" if index is None else colors[index % len(colors)]
        pool_ax.add_patch(_square(x, y, color))
        label = str(block_id) if row is None else f"{block_id}\n{row[4]}/{block_size}"
        pool_ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=7)
    pool_ax.set_xlim(0, per_row)
    pool_ax.set_ylim((highest - 1) // per_row + 1, 0)
    pool_ax.set_aspect("equal")
    pool_ax.set_xticks([])
    pool_ax.set_yticks([])
    pool_ax.set_title(f"The pool: physical blocks 1-{highest} (grey: free)\nlabel: id, tokens held")
    for index, table in enumerate(tables_by_request.values()):
        color = colors[index % len(colors)]
        for logical, physical, _first, _last, fill in table:
            table_ax.add_patch(_square(logical, index, color, fill / block_size, "none"))
            table_ax.add_patch(_square(logical, index, "none", edgecolor="black"))
            table_ax.text(logical + 0.5, index + 0.5, str(physical), ha="center", va="center")
    longest = max((len(t) for t in tables_by_request.values()), default=1)
    table_ax.set_xlim(0, longest)
    table_ax.set_ylim(len(tables_by_request), 0)
    table_ax.set_yticks([i + 0.5 for i in range(len(tables_by_request))])
    table_ax.set_yticklabels(list(tables_by_request))
    table_ax.set_xticks([i + 0.5 for i in range(longest)])
    table_ax.set_xticklabels([str(i) for i in range(longest)])
    table_ax.set_xlabel(f"logical block (tokens i*{block_size} to i*{block_size}+{block_size - 1})")
    table_ax.set_title(
        f"Block tables at step {snapshot.get('step', '-')}\n"
        "cell: the physical block; shading: how full it is"
    )
    figure.suptitle("Four requests decoding together: contiguous tables, interleaved pool")
    save_png(figure, path)


def _square(
    x: float, y: float, color: str, width: float = 1.0, edgecolor: str = "white"
) -> Rectangle:
    return Rectangle((x, y), width, 1.0, facecolor=color, edgecolor=edgecolor, linewidth=1)
