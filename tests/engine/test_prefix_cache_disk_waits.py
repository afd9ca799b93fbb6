"""A request whose prefix is read from disk waits outside the scheduler; others step on."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.disk_store import DiskBlockStore

PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(count)]


PROMPT = tokens(1, 22)  # 5 full blocks of 4 and 2 tokens
OTHER = tokens(2, 9)


@pytest.fixture
def llm(tiny_model_dir: Path, tmp_path: Path) -> LLM:
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        block_size=4,
        num_blocks=64,
        prefix_cache_dir=str(tmp_path / "prefix"),
    )
    llm.generate({"prompt_token_ids": PROMPT}, PARAMS, use_tqdm=False)
    tier = llm.llm_engine.disk_tier
    assert tier is not None
    tier.flush()
    assert llm.llm_engine.reset_prefix_cache()  # the pool forgets; the disk keeps them
    return llm


@pytest.fixture
def held_reads(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Reads from disk wait until the returned event is set."""
    release = threading.Event()
    read = DiskBlockStore.read

    def held(self: DiskBlockStore, *args: Any) -> bytes | None:
        assert release.wait(20)
        return read(self, *args)

    monkeypatch.setattr(DiskBlockStore, "read", held)
    return release


def run_to_end(llm: LLM) -> dict[str, list[int]]:
    finished = {}
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    return finished


def test_a_request_reading_from_disk_lets_others_run_and_then_hits(
    tiny_model_dir: Path, llm: LLM, held_reads: threading.Event
) -> None:
    reference = LLM(str(tiny_model_dir), dtype="float32", block_size=4, enable_prefix_caching=False)
    expected = reference.generate({"prompt_token_ids": PROMPT}, PARAMS, use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("from-disk", {"prompt_token_ids": PROMPT}, PARAMS)
    engine.add_request("other", {"prompt_token_ids": OTHER}, PARAMS)
    for _ in range(3):
        engine.step()
        assert "from-disk" not in engine.scheduler.requests  # still waiting for its reads
        assert [r.request_id for r in engine.scheduler.running] == ["other"]
    held_reads.set()
    hits_before = engine.stats.prefix_cache_hits
    finished = run_to_end(llm)
    assert finished["from-disk"] == expected[0].outputs[0].token_ids
    assert engine.stats.prefix_cache_hits - hits_before == 20
    snapshot = engine.stats.disk_tier
    assert snapshot is not None and snapshot.counters.loads == 5
    assert engine.stats.num_blocks_free == engine.stats.num_blocks_total


def test_a_request_aborted_while_reading_from_disk_leaves_no_block_held(
    llm: LLM, held_reads: threading.Event
) -> None:
    engine = llm.llm_engine
    engine.add_request("from-disk", {"prompt_token_ids": PROMPT}, PARAMS)
    engine.step()
    engine.abort_request("from-disk")
    held_reads.set()
    assert not engine.has_unfinished_requests()
    engine.add_request("other", {"prompt_token_ids": OTHER}, PARAMS)
    run_to_end(llm)
    assert engine.disk_tier is not None and len(engine.disk_tier) == 0
    assert engine.stats.num_blocks_free == engine.stats.num_blocks_total


def test_blocks_past_the_write_queue_bound_are_dropped_not_waited_for(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvserve.engine.disk_tier.WRITE_QUEUE_BYTES", 0)
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, prefix_cache_dir=str(tmp_path))
    output = llm.generate({"prompt_token_ids": PROMPT}, PARAMS, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 5
    snapshot = llm.llm_engine.stats.disk_tier
    assert snapshot is not None
    # The prompt's 5 full blocks; generated tokens are never written.
    assert snapshot.counters.writes == 0 and snapshot.counters.write_drops == 5


def test_the_sequences_of_one_prompt_share_one_read(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[bytes] = []
    read = DiskBlockStore.read

    def counted(self: DiskBlockStore, block_hash: bytes, *args: Any) -> bytes | None:
        reads.append(block_hash)
        return read(self, block_hash, *args)

    monkeypatch.setattr(DiskBlockStore, "read", counted)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert len(output.outputs) == 3
    assert len(reads) == len(set(reads)) == 5
    stats = llm.llm_engine.stats
    assert stats.prefix_cache_hits == 3 * 20
    assert stats.num_blocks_free == stats.num_blocks_total


def test_step_records_carry_the_disk_tiers_loads_and_writes(llm: LLM) -> None:
    """The trace's per-step shares add up to the tier's own counters over the traced steps."""
    from kvserve.trace import TraceMemory, runs_from_records

    engine = llm.llm_engine
    before = engine.stats.disk_tier
    assert before is not None
    trace = TraceMemory()
    engine.set_trace(trace)
    llm.generate({"prompt_token_ids": PROMPT + OTHER}, PARAMS, use_tqdm=False)
    engine.set_trace(None)
    after = engine.stats.disk_tier
    assert after is not None
    steps = runs_from_records(trace.records)[0].steps
    loads = sum(step.get("disk_loads", 0) for step in steps)
    assert loads == after.counters.loads - before.counters.loads > 0
    writes = sum(step.get("disk_writes", 0) for step in steps)
    assert 0 <= writes <= after.counters.writes - before.counters.writes
