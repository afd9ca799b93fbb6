"""The dashboard's replay of a step trace recorded from a real engine.

A tiny Llama runs prompts longer than the step budget in a pool too small
for all of them, with the trace on. Prefix caching is off, so no block is
shared and the replay's simulated placement must account for exactly the
blocks the engine held: in every step that finished nothing, the blocks the
frame's requests hold add up to the trace's ``blocks_used`` (in a step that
finished requests, the trace counts their blocks too: they were freed after
the forward pass). Tokens come from
the outputs ``generate`` returned.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.dashboard.replay import TraceReplay
from kvserve.dashboard.replay_app import build_replay_app
from kvserve.errors import InvalidParameterError
from kvserve.trace import TraceMemory, runs_from_records
from model_fixtures import save_tiny_model, train_tiny_tokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 17  # 16 usable: two long requests at once run out, so some are preempted


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    prompts = [list(range(20 + i, 45 + 3 * i)) for i in range(4)]
    memory = TraceMemory()
    llm.llm_engine.set_trace(memory)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    llm.llm_engine.set_trace(None)
    (trace_run,) = runs_from_records(memory.records)
    frames = [json.loads(frame) for frame in TraceReplay(trace_run).frames]
    return trace_run, outputs, frames


def held(frame: dict[str, Any]) -> list[list[int]]:
    return [
        [
            first + k
            for first, count in zip(r["blocks"][::2], r["blocks"][1::2], strict=True)
            for k in range(count)
        ]
        for r in frame["requests"]
    ]


def test_one_frame_per_step_with_the_steps_tokens(run: Any) -> None:
    trace_run, _, frames = run
    assert len(frames) == len(trace_run.steps)
    for step, frame in zip(trace_run.steps, frames, strict=True):
        last = frame["steps"][-1]
        assert last["step"] == step["step"]
        assert last["decode"] + last["prefill"] == step["num_tokens"]
        assert frame["layout"] == "simulated" and frame["num_blocks"] == NUM_BLOCKS - 1


def test_simulated_blocks_add_up_to_what_the_engine_held(run: Any) -> None:
    trace_run, _, frames = run
    checked = 0
    for step, frame in zip(trace_run.steps, frames, strict=True):
        tables = held(frame)
        flat = [block for table in tables for block in table]
        assert len(flat) == len(set(flat)), "a block placed twice"
        assert all(1 <= block <= NUM_BLOCKS - 1 for block in flat)
        for request, table in zip(frame["requests"], tables, strict=True):
            assert len(table) == math.ceil(request["computed_tokens"] / BLOCK_SIZE)
        assert len(flat) == frame["blocks_used"]
        if not step["finished"]:
            assert len(flat) == step["blocks_used"]
            checked += 1
    assert checked > 10
    assert frames[-1]["blocks_used"] == 0
    assert frames[-1]["requests"] == [] and held(frames[-1]) == []


def test_preempted_requests_show_as_such_and_tokens_match_the_outputs(run: Any) -> None:
    trace_run, outputs, frames = run
    phases = {r["phase"] for frame in frames for r in frame["requests"]}
    assert {"prefilling", "decoding", "preempted"} <= phases
    assert frames[-1]["num_preemptions"] == sum(len(s["preempted"]) for s in trace_run.steps) > 0
    last_seen: dict[str, dict[str, Any]] = {}
    for frame in frames:
        for request in frame["requests"]:
            last_seen[request["id"]] = request
    for output in outputs:
        seen = last_seen[output.request_id]
        assert seen["prompt_tokens"] == len(output.prompt_token_ids)
        # The frame before the last step: every token but the last was generated.
        assert seen["output_tokens"] == len(output.outputs[0].token_ids) - 1


def test_the_replay_command_refuses_a_missing_trace_or_run(
    run: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dashboard", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "trace" in capsys.readouterr().err
    trace_run, _, _ = run
    path = tmp_path / "one-run.jsonl"
    records = [trace_run.header, *trace_run.steps]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(InvalidParameterError, match=r"run: must be in \[0, 0\], got 1"):
        build_replay_app(path, 1)
    app = build_replay_app(path, 0)
    assert any(getattr(route, "path", "") == "/dashboard/replay/frames" for route in app.routes)
