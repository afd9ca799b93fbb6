"""Dashboard frames from a real scheduler and block pool (fake model: every sample is token 7).

The expected block counts and sharing come from the requests' tokens alone:
a request that has computed ``c`` tokens holds ``ceil(c / block_size)``
blocks, and two requests whose prompts agree on ``k`` full blocks share
exactly those ``k`` blocks.
"""

from __future__ import annotations

import math
from typing import Any

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler
from kvserve.core.stats import collect_stats, view_pool
from kvserve.core.step_report import PoolView, RunInfo
from kvserve.dashboard.sampler import EngineStateSampler
from kvserve.dashboard.state import Frame, block_runs
from kvserve.engine.iteration_stats import IterationStats
from kvserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


class FakeEngine:
    """What the sampler reads of an LLMEngine, over a real scheduler; steps sample token 7."""

    def __init__(self, num_blocks: int = 64, budget: int = 16, caching: bool = False) -> None:
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8)
        self.kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching)
        self.run_info = RunInfo(
            model="fake",
            block_size=BLOCK_SIZE,
            num_blocks=self.kv_cache_manager.num_usable_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
            policy=config.policy,
            enable_prefix_caching=caching,
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager, max_model_len=4096)
        self.num_steps = 0
        self.stats = collect_stats(self.scheduler, self.scheduler.schedule(), 0)

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8) -> Request:
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens))
        self.scheduler.add_request(request)
        return request

    def step(self) -> IterationStats:
        output = self.scheduler.schedule()
        sampled = {item.request.request_id: 7 for item in output.scheduled if item.samples}
        self.scheduler.update_from_output(output, sampled)
        self.num_steps += 1
        self.stats = collect_stats(self.scheduler, output, self.num_steps)
        return IterationStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=0,
            num_kv_blocks_total=0,
            ran_step=True,
            num_preemptions=output.num_preempted,
            num_generation_tokens=len(sampled),
            report=self.stats,
        )

    def view_pool(self, max_waiting: int) -> PoolView:
        return view_pool(self.scheduler, max_waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def expand(runs: list[int]) -> list[int]:
    return [
        first + k for first, count in zip(runs[::2], runs[1::2], strict=True) for k in range(count)
    ]


def sampler_for(
    engine: FakeEngine, watching: bool = True, **kwargs: Any
) -> tuple[EngineStateSampler, list[Frame]]:
    frames: list[Frame] = []
    sampler = EngineStateSampler(
        engine,
        frames.append,
        lambda: watching,
        **kwargs,
    )
    return sampler, frames


def test_block_runs_compress_consecutive_ids_and_expand_back() -> None:
    ids = [5, 6, 7, 20, 21, 3, 9]
    assert block_runs(ids) == [5, 3, 20, 2, 3, 1, 9, 1]
    assert expand(block_runs(ids)) == ids
    assert block_runs([]) == []


def test_each_running_request_holds_the_blocks_its_computed_tokens_need() -> None:
    engine = FakeEngine(budget=16)
    engine.add("a", list(range(10, 40)))  # 30 tokens: two chunks of the 16-token budget
    engine.add("b", list(range(50, 55)))
    sampler, _ = sampler_for(engine)
    engine.step()
    frame = sampler.frame(sampler.clock())
    by_id = {r["id"]: r for r in frame["requests"]}
    assert by_id["a"]["phase"] == "prefilling" and by_id["a"]["computed_tokens"] == 16
    assert by_id["b"]["phase"] == "waiting" and by_id["b"]["blocks"] == []
    for _ in range(3):
        engine.step()
    frame = sampler.frame(sampler.clock())
    held: list[int] = []
    for request in frame["requests"]:
        blocks = expand(request["blocks"])
        assert request["phase"] == "decoding"
        assert len(blocks) == math.ceil(request["computed_tokens"] / BLOCK_SIZE)
        held += blocks
    assert len(held) == len(set(held)) == frame["blocks_used"]
    assert frame["num_blocks"] == 63 and frame["budget"] == 16


def test_requests_with_a_common_prefix_share_exactly_its_full_blocks() -> None:
    engine = FakeEngine(caching=True, budget=64)
    prefix = list(range(100, 114))  # 14 tokens: 3 full blocks, then 2 more tokens
    engine.add("first", [*prefix, 1, 2, 3])
    sampler, _ = sampler_for(engine)
    engine.step()
    engine.add("second", [*prefix, 4, 5, 6, 7])
    engine.step()
    frame = sampler.frame(sampler.clock())
    blocks = {r["id"]: expand(r["blocks"]) for r in frame["requests"]}
    shared = set(blocks["first"]) & set(blocks["second"])
    assert shared == set(blocks["first"][:3]) == set(blocks["second"][:3])
    while engine.has_unfinished_requests():
        engine.step()
    frame = sampler.frame(sampler.clock())
    assert frame["requests"] == [] and frame["blocks_used"] == 0
    # Every full block of both sequences stays cached, free: 3 shared + the rest of each.
    assert len(expand(frame["cached_free"])) == frame["blocks_cached"] > 3


def test_a_preempted_request_is_shown_preempted_and_holding_nothing() -> None:
    engine = FakeEngine(num_blocks=9, budget=64)  # 8 usable blocks: 32 token slots
    engine.add("old", list(range(10, 22)), max_tokens=12)
    engine.add("new", list(range(30, 42)), max_tokens=12)
    sampler, _ = sampler_for(engine)
    preempted = None
    for _ in range(12):
        stats = engine.step()
        frame = sampler.frame(sampler.clock())
        if stats.num_preemptions:
            preempted = {r["id"]: r for r in frame["requests"]}["new"]
            break
    assert preempted is not None, "the pool was sized to force a preemption"
    assert preempted["phase"] == "preempted"
    assert preempted["blocks"] == [] and preempted["preemptions"] == 1


def test_frames_come_at_most_ten_a_second_and_only_while_watched() -> None:
    engine = FakeEngine()
    engine.add("a", list(range(10, 20)), max_tokens=400)
    clock = Clock()
    sampler, frames = sampler_for(engine, clock=clock)
    for _ in range(300):  # 300 steps, 1 ms apart: 0.3 s
        clock.now += 0.001
        sampler.observe(engine.step())
    assert 3 <= len(frames) <= 4
    assert [s["step"] for s in frames[-1]["steps"]] == list(
        range(frames[-1]["num_steps"] - 63, frames[-1]["num_steps"] + 1)
    )

    unwatched, unwatched_frames = sampler_for(engine, watching=False, clock=clock)
    for _ in range(50):
        clock.now += 0.01
        unwatched.observe(engine.step())
    assert unwatched_frames == []


def test_the_engine_going_idle_always_publishes_one_last_frame() -> None:
    engine = FakeEngine()
    engine.add("a", list(range(10, 20)), max_tokens=3)
    clock = Clock()
    sampler, frames = sampler_for(engine, watching=False, clock=clock)
    while engine.has_unfinished_requests():
        sampler.observe(engine.step())  # no time passes: the rate limit alone would skip it
    assert len(frames) == 1 and frames[0]["requests"] == [] and frames[0]["blocks_used"] == 0
    idle = IterationStats(num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=0)
    sampler.observe(idle)
    assert len(frames) == 1
    # The next time work runs out, unwatched as before, the latest frame is new again.
    engine.add("b", list(range(30, 45)), max_tokens=3)
    sampler.observe(engine.step())
    assert len(frames) == 1
    while engine.has_unfinished_requests():
        sampler.observe(engine.step())
    assert len(frames) == 2 and frames[1]["requests"] == [] and frames[1]["blocks_used"] == 0
    assert frames[1]["num_steps"] > frames[0]["num_steps"]


def test_token_rates_count_the_steps_of_the_last_seconds() -> None:
    engine = FakeEngine(num_blocks=256, budget=64)  # room for all: no preemption
    for i in range(4):
        engine.add(f"r{i}", list(range(10, 14)), max_tokens=200)
    clock = Clock()
    sampler, _ = sampler_for(engine, clock=clock)
    for _ in range(100):  # 4 tokens a step, a step every 10 ms: 400 tok/s
        clock.now += 0.01
        sampler.observe(engine.step())
    frame = sampler.frame(clock.now)
    assert abs(frame["output_tok_s"] - 400) < 1
