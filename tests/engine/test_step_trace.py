"""The step trace records what the engine really did, token for token.

A tiny Llama runs prompts longer than the step budget (so prefills are
chunked) in a pool too small for all of them (so requests are preempted and
recomputed). Replaying the trace must reproduce every request's progress:
each chunk starts where the last one ended, a preemption sends it back to
zero, and at the end it has computed its prompt and all but its last output
token, as the outputs returned by ``generate`` say.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.outputs import RequestOutput
from kvserve.trace import (
    StepRecord,
    TraceFile,
    TraceMemory,
    read_trace,
    runs_from_records,
    to_chrome,
)
from model_fixtures import save_tiny_model, train_tiny_tokenizer

BLOCK_SIZE = 4
BUDGET = 16  # max_num_batched_tokens: every prompt below is longer
MAX_TOKENS = 12
# 16 usable blocks of 4 tokens; each request grows to 8-11 blocks, so two at once run out.
NUM_BLOCKS = 17


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=4,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,  # a re-admitted request then recomputes from token 0
    )


def prompts(vocab_size: int) -> list[dict[str, list[int]]]:
    rng = random.Random(7)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randint(20, 30))]}
        for _ in range(4)
    ]


@pytest.fixture(scope="module")
def traced(llm: LLM) -> tuple[TraceMemory, list[RequestOutput]]:
    trace = TraceMemory()
    llm.llm_engine.set_trace(trace)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts(llm.llm_engine.vocab_size), params, use_tqdm=False)
    llm.llm_engine.set_trace(None)
    return trace, outputs


class Replay:
    """Each request's computed tokens, replayed from the trace alone."""

    def __init__(self, steps: Sequence[StepRecord]) -> None:
        self.position: dict[str, int] = {}
        self.computed: Counter[str] = Counter()  # tokens computed, recomputation included
        self.lost: Counter[str] = Counter()  # computed tokens dropped by preemptions
        self.finished: dict[str, dict[str, Any]] = {}
        for step in steps:
            for request_id in step["preempted"]:
                self.lost[request_id] += self.position[request_id]
                self.position[request_id] = 0
            for entry in step["scheduled"]:
                request_id = entry["id"]
                assert entry["start"] == self.position.get(request_id, 0), (step, entry)
                self.position[request_id] = entry["start"] + entry["tokens"]
                self.computed[request_id] += entry["tokens"]
            for finished in step["finished"]:
                self.finished[finished["id"]] = dict(finished)


def test_the_trace_shows_partial_prefill_chunks_and_preemptions(
    traced: tuple[TraceMemory, list[RequestOutput]],
) -> None:
    trace, _ = traced
    steps = trace.steps()
    entries = [entry for step in steps for entry in step["scheduled"]]
    assert any(entry["phase"] == "prefill" and entry["partial"] for entry in entries)
    assert any(step["preempted"] for step in steps)
    assert any(entry["phase"] == "recompute" for entry in entries)
    assert any(entry["phase"] == "decode" for entry in entries)
    for step in steps:
        assert step["num_tokens"] <= BUDGET
        assert step["blocks_used"] + step["blocks_free"] == NUM_BLOCKS - 1
        for entry in step["scheduled"]:
            if entry["phase"] == "decode":
                assert entry["tokens"] == 1 and entry["start"] >= entry["prompt_len"]
            # A chunk is partial exactly when it stops before the request's last known token.
            if entry["phase"] == "prefill":
                end = entry["start"] + entry["tokens"]
                assert entry["partial"] == (end < entry["prompt_len"])


def test_the_token_counts_add_up_to_every_request_s_prompt_and_output(
    traced: tuple[TraceMemory, list[RequestOutput]],
) -> None:
    trace, outputs = traced
    replay = Replay(trace.steps())
    assert sum(replay.lost.values()) > 0  # the preemptions did cost recomputation
    assert set(replay.finished) == {output.request_id for output in outputs}
    for output in outputs:
        request_id = output.request_id
        num_prompt = len(output.prompt_token_ids)
        num_output = len(output.outputs[0].token_ids)
        assert num_output == MAX_TOKENS
        # The last sampled token is never fed back, so its K/V is never computed.
        assert replay.position[request_id] == num_prompt + num_output - 1
        assert replay.computed[request_id] == num_prompt + num_output - 1 + replay.lost[request_id]
        assert replay.finished[request_id] == {
            "id": request_id,
            "reason": "length",
            "prompt_len": num_prompt,
            "output_len": num_output,
        }


def test_steps_are_numbered_and_timed_in_order(
    traced: tuple[TraceMemory, list[RequestOutput]],
) -> None:
    trace, _ = traced
    header = trace.records[0]
    assert header["kind"] == "run" and header["block_size"] == BLOCK_SIZE
    assert header["num_blocks"] == NUM_BLOCKS - 1
    steps = trace.steps()
    assert [step["step"] for step in steps] == list(range(len(steps)))
    for before, after in itertools.pairwise(steps):
        assert before["start_s"] <= before["end_s"] <= after["start_s"]


def test_the_chrome_trace_has_a_track_per_request_and_the_counters(
    traced: tuple[TraceMemory, list[RequestOutput]],
) -> None:
    trace, outputs = traced
    chrome = json.loads(json.dumps(to_chrome(runs_from_records(trace.records))))
    events = chrome["traceEvents"]
    tracks = {
        event["args"]["name"]: event["tid"]
        for event in events
        if event["ph"] == "M" and event["name"] == "thread_name"
    }
    assert set(tracks) == {"engine steps"} | {f"request {o.request_id}" for o in outputs}
    replay = Replay(trace.steps())
    for output in outputs:
        tid = tracks[f"request {output.request_id}"]
        slices = [event for event in events if event["ph"] == "X" and event["tid"] == tid]
        assert (
            sum(event["args"]["tokens"] for event in slices) == replay.computed[output.request_id]
        )
        assert {event["cat"] for event in slices} <= {"prefill", "decode", "recompute"}
        assert all(event["dur"] >= 0 for event in slices)
    step_slices = [e for e in events if e["ph"] == "X" and e["tid"] == tracks["engine steps"]]
    assert len(step_slices) == len(trace.steps())
    preemptions = [e for e in events if e["ph"] == "i" and e["name"] == "preempted"]
    assert len(preemptions) == sum(len(step["preempted"]) for step in trace.steps())
    counters = {event["name"] for event in events if event["ph"] == "C"}
    assert {"tokens per step", "KV blocks"} <= counters


def test_a_trace_file_reads_back_as_the_records_written(llm: LLM, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    memory = TraceMemory()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with TraceFile(path) as trace_file:
        # Two runs in one file, as a benchmark comparing two engines writes them.
        for sink in (trace_file, trace_file):
            llm.llm_engine.set_trace(sink)
            llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        llm.llm_engine.set_trace(memory)
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    llm.llm_engine.set_trace(None)
    runs = read_trace(path)
    assert [run.header["run"] for run in runs] == [0, 1]
    assert [len(run.steps) for run in runs] == [3, 3]  # one prefill, two decodes
    assert [entry["phase"] for step in runs[1].steps for entry in step["scheduled"]] == [
        "prefill",
        "decode",
        "decode",
    ]

    def shape(steps: Sequence[StepRecord]) -> list[Any]:
        """Everything but the times and request ids, which differ from run to run."""
        return [
            [(e["phase"], e["start"], e["tokens"], e["partial"]) for e in step["scheduled"]]
            + [step["blocks_used"], step["num_tokens"], len(step["finished"])]
            for step in steps
        ]

    assert shape(memory.steps()) == shape(runs[1].steps) == shape(runs[0].steps)
