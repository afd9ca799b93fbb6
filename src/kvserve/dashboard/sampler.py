"""Frames of the engine's state, taken on the async engine's loop thread.

:class:`EngineStateSampler` is a stats observer of :class:`AsyncEngine`: it
runs on the loop thread after every iteration, the one place where asking
the engine for a picture of its pool needs no lock. Each call records the
step's :class:`StepReport` (a few ints) and the latencies the iteration
reported; at most ``max_rate_hz`` times a second, and only while someone
watches, it formats a :class:`Frame` from the engine's :class:`PoolView`
(``LLMEngine.view_pool``), its :class:`RunInfo` and its latest report (the
running totals of speculation and the disk tier), and hands it to
``publish``, which must not block (the hub queues it onto the event loop).
Building a frame is the only real cost: its interval also stretches so that
frames take at most ``max_cost_fraction`` of the loop's time, whatever the
pool's size.

When the engine runs out of work, a last frame is always published, even
with nobody watching, so the latest frame is never a stale picture of busy
blocks (the loop sleeps until new work comes, and takes no frame meanwhile).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvserve.core.step_report import PoolView, RunInfo, StepReport
from kvserve.dashboard.rolling import (
    NUM_LATENCY_SAMPLES,
    RATE_WINDOW_S,
    RateWindow,
    latency_percentiles,
)
from kvserve.dashboard.state import (
    MAX_LISTED_WAITING,
    NUM_RECENT_STEPS,
    Frame,
    SpecState,
    StepState,
    block_runs,
    disk_tier_state,
    request_state,
    spec_state,
)
from kvserve.engine.iteration_stats import IterationStats


class PoolSource(Protocol):
    """What the sampler asks of the engine (an ``LLMEngine``): its settings, its latest
    step report and, for a frame, a picture of its pool."""

    run_info: RunInfo
    stats: StepReport

    def view_pool(self, max_waiting: int) -> PoolView: ...

    def has_unfinished_requests(self) -> bool: ...


class EngineStateSampler:
    """Records steps after each loop iteration and publishes frames at a bounded rate.

    publish: takes a frame; called on the loop thread, so it must return at once.
    has_watchers: whether anyone wants frames now (read on the loop thread).
    max_rate_hz: the most frames a second.
    max_cost_fraction: frames may take at most this share of the loop's time.
    """

    def __init__(
        self,
        engine: PoolSource,
        publish: Callable[[Frame], None],
        has_watchers: Callable[[], bool],
        max_rate_hz: float = 10.0,
        max_cost_fraction: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not max_rate_hz > 0:
            raise ValueError(f"max_rate_hz must be > 0, got {max_rate_hz}")
        if not 0 < max_cost_fraction <= 1:
            raise ValueError(f"max_cost_fraction must be in (0, 1], got {max_cost_fraction}")
        self.engine = engine
        self.publish = publish
        self.has_watchers = has_watchers
        self.min_interval_s = 1.0 / max_rate_hz
        self.max_cost_fraction = max_cost_fraction
        self.clock = clock
        self.started = clock()
        self.num_frames = 0
        self._steps: deque[StepState] = deque(maxlen=NUM_RECENT_STEPS)
        self._rates = RateWindow(RATE_WINDOW_S)
        self._spec_rates = RateWindow(RATE_WINDOW_S)  # proposed, accepted
        # The reports' speculation counters are running totals; a step's share is the change.
        self._spec_seen = (
            engine.stats.num_spec_proposed_tokens,
            engine.stats.num_spec_accepted_tokens,
        )
        self._ttft: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._itl: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._num_steps = 0
        self._next_frame_at = 0.0
        self._idle_published = False

    def observe(self, stats: IterationStats) -> None:
        """The async engine's stats observer: record, and publish a frame when one is due."""
        now = self.clock()
        if stats.report is not None:
            self._record(stats.report, stats, now)
        self._ttft.extend(stats.time_to_first_token)
        self._itl.extend(stats.inter_token_latency)
        idle = not self.engine.has_unfinished_requests()
        if idle:
            if self._idle_published:
                return
        else:
            self._idle_published = False  # so the end of this work gets its frame too
            if now < self._next_frame_at or not self.has_watchers():
                return
        frame = self.frame(now)
        self.publish(frame)
        self.num_frames += 1
        cost = self.clock() - now
        self._next_frame_at = now + max(self.min_interval_s, cost / self.max_cost_fraction)
        self._idle_published = idle

    def _record(self, report: StepReport, stats: IterationStats, now: float) -> None:
        """Keep a step for the step bars and the token rates."""
        self._num_steps = report.num_steps
        self._steps.append(
            StepState(
                step=report.num_steps,
                decode=report.num_decode_tokens,
                prefill=report.num_prefill_tokens,
                preempted=stats.num_preemptions,
                t=round(now - self.started, 4),
            )
        )
        self._rates.add(now, stats.num_generation_tokens, report.num_scheduled_tokens)
        seen_proposed, seen_accepted = self._spec_seen
        proposed, accepted = report.num_spec_proposed_tokens, report.num_spec_accepted_tokens
        self._spec_rates.add(now, proposed - seen_proposed, accepted - seen_accepted)
        self._spec_seen = (proposed, accepted)

    def frame(self, now: float) -> Frame:
        """The engine's state now (call on the loop thread only)."""
        info = self.engine.run_info
        pool = self.engine.view_pool(MAX_LISTED_WAITING)
        output_tok_s, computed_tok_s = self._rates.rates(now)
        report = self.engine.stats
        return Frame(
            time=round(now - self.started, 3),
            layout="exact",
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            requests=[request_state(sequence, now) for sequence in pool.sequences],
            num_running=pool.num_running,
            num_waiting=pool.num_waiting,
            num_waiting_unlisted=max(pool.num_waiting - MAX_LISTED_WAITING, 0),
            cached_free=block_runs(pool.cached_free_block_ids),
            blocks_used=pool.num_blocks_used,
            blocks_cached=pool.num_blocks_cached,
            steps=list(self._steps),
            num_steps=self._num_steps,
            num_preemptions=pool.num_preemptions,
            budget=info.max_num_batched_tokens,
            prefill_cap=info.max_prefill_tokens_while_decoding,
            output_tok_s=round(output_tok_s, 2),
            computed_tok_s=round(computed_tok_s, 2),
            ttft=latency_percentiles(self._ttft),
            itl=latency_percentiles(self._itl),
            spec=self._spec_state(info, report, now),
            disk=disk_tier_state(report),
        )

    def _spec_state(self, info: RunInfo, report: StepReport, now: float) -> SpecState | None:
        if info.spec_method is None:
            return None
        return spec_state(
            report.num_spec_proposed_tokens,
            report.num_spec_accepted_tokens,
            self._spec_rates.rates(now),
            info.spec_adaptive,
            report.num_spec_declined,
        )
