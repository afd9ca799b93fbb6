"""The dashboard's speculation and disk-tier figures, from real engine runs on the tiny Llama.

The engine is stepped by hand, each step 10 ms after the last on a fake
clock, and the dashboard's sampler observes every step as the async
engine's loop would. The references are independent of the sampler: the
step trace recorded at the same time (its per-step proposed and accepted
tokens, summed), the arithmetic of the prompt's blocks, and the files the
disk tier left in its folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvserve import SamplingParams
from kvserve.dashboard.replay import TraceReplay
from kvserve.dashboard.rolling import RATE_WINDOW_S
from kvserve.dashboard.sampler import EngineStateSampler
from kvserve.dashboard.state import Frame
from kvserve.engine import LLMEngine
from kvserve.engine.iteration_stats import IterationStats
from kvserve.trace import TraceMemory, runs_from_records

BLOCK_SIZE = 4
STEP_S = 0.01
# Every decoding request proposes (not adaptive), so what is counted never depends on timing.
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "adaptive": False}
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Watched:
    """An engine with a sampler observing each step, as the async engine's loop does."""

    def __init__(self, model_dir: Path, **engine_args: Any) -> None:
        args: dict[str, Any] = dict(dtype="float32", block_size=BLOCK_SIZE, num_blocks=128)
        self.engine = LLMEngine.from_engine_args(str(model_dir), **{**args, **engine_args})
        self.clock = Clock()
        self.frames: list[Frame] = []
        self.sampler = EngineStateSampler(
            self.engine, self.frames.append, lambda: True, clock=self.clock
        )
        self.step_ends: list[float] = []  # the fake clock at each step that ran

    def run(self, prompts: list[list[int]]) -> None:
        for index, tokens in enumerate(prompts):
            self.engine.add_request(f"r{index}", {"prompt_token_ids": tokens}, PARAMS)
        while self.engine.has_unfinished_requests():
            self.step()

    def step(self) -> None:
        self.clock.now += STEP_S
        before = self.engine.stats.num_steps
        self.engine.step()
        report = self.engine.stats
        if report.num_steps > before:
            self.step_ends.append(self.clock.now)
        self.sampler.observe(
            IterationStats(
                num_running=report.num_running,
                num_waiting=report.num_waiting,
                num_kv_blocks_used=report.num_blocks_used,
                num_kv_blocks_total=report.num_blocks_total,
                ran_step=report.num_steps > before,
                report=report,
            )
        )

    def frame(self) -> Frame:
        return self.sampler.frame(self.clock.now)


def repeating_prompts() -> list[list[int]]:
    """Prompts that repeat a pattern, so that the n-gram lookup finds proposals."""
    rng = random.Random(11)
    prompts = []
    for _ in range(4):
        pattern = [rng.randrange(3, 300) for _ in range(rng.randint(2, 5))]
        prompts.append(pattern * rng.randint(3, 6))
    return prompts


@pytest.fixture(scope="module")
def speculating(tiny_model_dir: Path) -> tuple[Watched, list[dict[str, Any]]]:
    watched = Watched(tiny_model_dir, speculative_config=SPEC)
    memory = TraceMemory()
    watched.engine.set_trace(memory)
    watched.run(repeating_prompts())
    watched.engine.set_trace(None)
    (trace_run,) = runs_from_records(memory.records)
    return watched, trace_run


def test_speculation_totals_and_acceptance_match_the_trace(speculating: Any) -> None:
    watched, trace_run = speculating
    proposed = sum(step["spec_proposed"] for step in trace_run.steps)
    accepted = sum(step["spec_accepted"] for step in trace_run.steps)
    assert proposed > 0 and accepted > 0, "repeating prompts on a looping model must propose"
    spec = watched.frame()["spec"]
    assert spec is not None
    assert (spec["proposed"], spec["accepted"]) == (proposed, accepted)
    assert spec["acceptance"] == pytest.approx(accepted / proposed, abs=1e-4)
    assert spec["adaptive"] is False and spec["declined"] == 0
    # Without a disk tier there is no disk entry.
    assert watched.frame()["disk"] is None


def test_speculation_rates_count_the_steps_of_the_last_seconds(speculating: Any) -> None:
    watched, trace_run = speculating
    ends = watched.step_ends
    assert len(ends) == len(trace_run.steps) and ends[-1] - ends[0] < RATE_WINDOW_S
    # Every step is in the window; the oldest only opens it (as for the token rates).
    span = watched.clock.now - ends[0]
    later = trace_run.steps[1:]
    spec = watched.frame()["spec"]
    assert spec is not None
    proposed_tok_s = sum(step["spec_proposed"] for step in later) / span
    accepted_tok_s = sum(step["spec_accepted"] for step in later) / span
    assert spec["proposed_tok_s"] == pytest.approx(proposed_tok_s, abs=0.01)
    assert spec["accepted_tok_s"] == pytest.approx(accepted_tok_s, abs=0.01)
    assert 0 < spec["accepted_tok_s"] < spec["proposed_tok_s"]


def test_the_replay_shows_the_traces_speculation_without_the_policys_declines(
    speculating: Any,
) -> None:
    watched, trace_run = speculating
    live = watched.frame()["spec"]
    frames = [json.loads(frame) for frame in TraceReplay(trace_run).frames]
    replayed = frames[-1]["spec"]
    assert (replayed["proposed"], replayed["accepted"]) == (live["proposed"], live["accepted"])
    assert replayed["acceptance"] == live["acceptance"]
    assert replayed["adaptive"] is None and replayed["declined"] is None
    assert frames[-1]["disk"] is None
    # Running totals: never falling, step by step.
    totals = [frame["spec"]["proposed"] for frame in frames]
    assert totals == sorted(totals) and totals[0] == trace_run.steps[0]["spec_proposed"]


def test_a_run_without_speculation_has_no_speculation_entry(tiny_model_dir: Path) -> None:
    watched = Watched(tiny_model_dir)
    watched.run(repeating_prompts()[:1])
    assert watched.frame()["spec"] is None


def test_requests_the_adaptive_policy_declined_are_counted(tiny_model_dir: Path) -> None:
    watched = Watched(tiny_model_dir, speculative_config={**SPEC, "adaptive": True})
    policy = watched.engine.scheduler.spec_policy
    assert policy is not None
    # Teach the policy that every row past the first doubles the step, and keep it so:
    # then no proposal pays, and every decision declines (but for a periodic probe).
    for rows in range(1, 12):
        for _ in range(3):
            policy.observe_step(rows, 0.01 * 2 ** (rows - 1))
    policy.observe_step = lambda rows, seconds: None  # type: ignore[method-assign]
    watched.run(repeating_prompts())
    spec = watched.frame()["spec"]
    assert spec is not None and spec["adaptive"] is True
    assert spec["declined"] == policy.num_declined > 0
    # Four requests decode for about 23 steps each: most decisions declined.
    assert spec["declined"] > 40


def files_in(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file() and path.parent != folder]


def test_disk_tier_figures_match_its_files_and_the_prompts_blocks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    prompt = list(range(40, 70))  # 30 tokens: 7 full blocks and 2 tokens
    first = Watched(tiny_model_dir, prefix_cache_dir=str(tmp_path))
    first.run([prompt])
    assert first.engine.disk_tier is not None
    first.engine.disk_tier.flush()
    first.step()  # an empty step: its report reads the counters after the flush
    written = files_in(tmp_path)
    file_bytes = written[0].stat().st_size
    disk = first.frame()["disk"]
    assert disk is not None and disk["enabled"]
    # The prompt's full blocks were written; those its 23 generated tokens filled were not.
    assert disk["writes"] == len(written) == 30 // BLOCK_SIZE
    assert disk["bytes_written"] == disk["num_bytes"] == len(written) * file_bytes
    assert (disk["disk_hits"], disk["loads"], disk["pool_hit_tokens"]) == (0, 0, 0)
    assert first.frame()["spec"] is None
    first.engine.shutdown()

    # A new engine on the same folder, bounded to 16 files: it reads the prompt back,
    # then a longer prompt's blocks push the oldest files out.
    second = Watched(
        tiny_model_dir, prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=16 * file_bytes
    )
    second.run([prompt])
    disk = second.frame()["disk"]
    assert disk is not None
    assert disk["disk_hits"] == disk["loads"] == 7
    assert disk["bytes_read"] == 7 * file_bytes
    assert (disk["query_tokens"], disk["pool_hit_tokens"]) == (30, 28)
    second.run([list(range(100, 160))])
    assert second.engine.disk_tier is not None
    second.engine.disk_tier.flush()
    second.step()
    disk = second.frame()["disk"]
    assert disk is not None
    remaining = files_in(tmp_path)
    assert disk["num_bytes"] == len(remaining) * file_bytes <= 16 * file_bytes
    assert disk["evictions"] == len(written) + disk["writes"] - len(remaining) > 0
    second.engine.shutdown()
