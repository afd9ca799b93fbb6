"""``kvserve demo schedule`` on a tiny random Llama: the per-step view adds up to every
request's prompt and output, chunked steps stay within the budget, and unchunked prompts
are computed whole."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from kvserve.demos import DemoResult, run_demo
from kvserve.demos.context import DemoContext
from kvserve.demos.registry import demo_names
from model_fixtures import save_tiny_model, train_tiny_tokenizer

BUDGET = 16
LONG_PROMPT = 40
STREAM_TOKENS = 10
SIZES = {
    "num_streams": 3,
    "stream_tokens": STREAM_TOKENS,
    "long_prompt_len": LONG_PROMPT,
    "long_arrivals": (2, 5),
    "long_max_tokens": 3,
    "chunk_budget": BUDGET,
    "repetitions": 2,
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())
    ctx = DemoContext(model=str(model_dir), dtype="float32", sizes=SIZES)
    return run_demo("schedule", ctx)


def test_the_demo_is_registered() -> None:
    assert "schedule" in demo_names()


@pytest.mark.parametrize("mode", ["chunked", "unchunked"])
def test_the_steps_compute_every_prompt_and_output_token_once(
    result: DemoResult, mode: str
) -> None:
    requests = result.data["requests"]
    steps = result.data["modes"][mode]["steps"]
    chunks = defaultdict(list)
    for step in steps:
        prompt_tokens = sum(c["end"] - c["start"] for c in step["chunks"])
        assert step["num_tokens"] == step["decode_tokens"] + prompt_tokens
        assert prompt_tokens == step["partial_chunk_tokens"] + step["last_chunk_tokens"]
        for chunk in step["chunks"]:
            chunks[chunk["id"]].append(chunk)
    for request in requests:
        # Its chunks tile the prompt in order; only the last one samples.
        own = chunks[request["id"]]
        assert own[0]["start"] == 0 and own[-1]["end"] == request["prompt_tokens"]
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(own))
        assert [c["partial"] for c in own] == [True] * (len(own) - 1) + [False]
    # The last chunk samples the first output token; each later one takes a decode step.
    assert sum(step["decode_tokens"] for step in steps) == sum(
        request["output_tokens"] - 1 for request in requests
    )
    assert sum(step["num_tokens"] for step in steps) == sum(
        request["prompt_tokens"] + request["output_tokens"] - 1 for request in requests
    )


def test_chunked_steps_stay_within_the_budget_and_unchunked_prompts_come_whole(
    result: DemoResult,
) -> None:
    chunked = result.data["modes"]["chunked"]
    unchunked = result.data["modes"]["unchunked"]
    assert chunked["budget"] == BUDGET
    assert max(step["num_tokens"] for step in chunked["steps"]) <= BUDGET
    assert any(step["partial_chunk_tokens"] for step in chunked["steps"])
    assert not any(step["partial_chunk_tokens"] for step in unchunked["steps"])
    long_chunks = [c for s in unchunked["steps"] for c in s["chunks"] if c["id"].startswith("L")]
    assert [(c["start"], c["end"]) for c in long_chunks] == [(0, LONG_PROMPT)] * 2
    assert max(step["num_tokens"] for step in unchunked["steps"]) > BUDGET


def test_every_stream_has_a_latency_for_each_token_after_its_first(result: DemoResult) -> None:
    for view in result.data["modes"].values():
        assert view["repetitions"] == 2
        itls = view["stream_itl_ms"]
        assert set(itls) == {"s0", "s1", "s2"}
        for gaps in itls.values():
            assert len(gaps) == STREAM_TOKENS - 1 and all(gap > 0 for gap in gaps)
        assert view["itl_max_ms"] == max(max(gaps) for gaps in itls.values())
        assert all(step["ms"] > 0 for step in view["steps"])


def test_the_tables_and_files_hold_the_same_numbers(result: DemoResult, tmp_path: Path) -> None:
    summary, chunked_table, unchunked_table = result.tables
    modes = result.data["modes"]
    assert [row[2] for row in summary.rows] == [len(modes[m]["steps"]) for m in modes]
    for table, mode in ((chunked_table, "chunked"), (unchunked_table, "unchunked")):
        with_chunks = [step for step in modes[mode]["steps"] if step["chunks"]]
        assert [row[0] for row in table.rows] == [step["step"] for step in with_chunks]
    written = result.write(tmp_path)
    saved = json.loads(written.json_path.read_text(encoding="utf-8"))
    assert saved["data"]["modes"]["chunked"]["steps"] == modes["chunked"]["steps"]
    assert written.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
