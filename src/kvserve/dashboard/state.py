"""One frame of the dashboard: the engine's state at a moment, as plain JSON-ready data.

The live stream (``sampler.py``) and the trace replay (``replay.py``) both
produce :class:`Frame` dicts, and the page draws either the same way. Lists
of block ids travel as runs, a flat ``[first, count, first, count, ...]``:
the free queue hands out consecutive ids, so a request's table is a few runs
however many blocks it holds, and a frame of a large pool stays small.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypedDict

from kvserve.core.request import RequestStatus
from kvserve.core.step_report import SequenceView, StepReport

Phase = Literal["waiting", "prefilling", "decoding", "preempted"]
# Waiting requests beyond this many are counted, not listed: a queue of
# hundreds would make every frame large and the table unreadable.
MAX_LISTED_WAITING = 64
# Steps a frame carries for the step bars, oldest first.
NUM_RECENT_STEPS = 64


class RequestState(TypedDict):
    """One sequence (a request, or ``id#i`` of one with n > 1).

    phase: ``waiting`` (never ran), ``prefilling`` (computing its prompt, or
        its tokens again after a preemption), ``decoding`` (one token per
        step), ``preempted`` (back in the queue, its blocks given up).
    computed_tokens: tokens with K/V in the cache; the prefill progress is
        ``computed_tokens / (prompt_tokens + output_tokens)``.
    age_s: seconds since it arrived (for a waiting one, how long it has waited).
    blocks: the blocks it holds, as runs (see the module docstring).
    """

    id: str
    phase: Phase
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    age_s: float
    preemptions: int
    blocks: list[int]


class StepState(TypedDict):
    """One engine step: tokens it computed, by kind, and the preemptions it caused.

    t: seconds since the source started, when the step ended.
    """

    step: int
    decode: int
    prefill: int
    preempted: int
    t: float


class Percentiles(TypedDict):
    p50: float
    p90: float
    p99: float
    count: int


class SpecState(TypedDict):
    """Speculative decoding (``speculative_config``); a frame has none while it is off.

    proposed, accepted: proposals verified, and how many of them were accepted,
        since the source started.
    proposed_tok_s, accepted_tok_s: the same per second over the last few
        seconds; their ratio is the recent acceptance.
    acceptance: accepted over proposed since the start; None before any proposal.
    adaptive: whether the adaptive policy decides each request's proposals;
        None where the source does not say (a trace).
    declined: decoding requests the adaptive policy gave no proposal (their
        rows were expected to cost more than they gain), since the start;
        None where the source does not record it (a trace).
    """

    proposed: int
    accepted: int
    proposed_tok_s: float
    accepted_tok_s: float
    acceptance: float | None
    adaptive: bool | None
    declined: int | None


class DiskTierState(TypedDict):
    """The prefix cache's disk tier (``prefix_cache_dir``); a frame has none without one.

    Counts are blocks, since the source started, except where the name says
    tokens or bytes. A field is None where the source does not record it (a
    trace records only loads and writes).

    query_tokens, pool_hit_tokens: prompt tokens looked up in the prefix cache
        when requests were admitted, and found in the pool (blocks read back
        from disk count once they are in it).
    disk_hits: blocks found on disk past the pool's hit.
    loads, writes: blocks read back into the pool, and written to disk.
    evictions: files deleted to keep the tier within its bound.
    bytes_read, bytes_written: file bytes moved; num_bytes: bytes on disk now.
    enabled: False once an I/O error turned the tier off.
    """

    query_tokens: int | None
    pool_hit_tokens: int | None
    disk_hits: int | None
    loads: int
    writes: int
    evictions: int | None
    bytes_read: int | None
    bytes_written: int | None
    num_bytes: int | None
    enabled: bool


class Frame(TypedDict):
    """The whole picture the page draws.

    time: seconds since the source (server or trace) started.
    layout: ``exact`` when the block ids are the engine's own; ``simulated``
        when a replay placed blocks itself (a trace records counts, not ids).
    num_blocks: usable blocks, ids ``1..num_blocks`` (block 0 is the null block).
    requests: running ones first (in the running set's order), then waiting
        ones in queue order, at most :data:`MAX_LISTED_WAITING` of those.
    num_waiting_unlisted: waiting requests left out of ``requests``.
    cached_free: blocks nobody holds that keep a cached prefix, as runs.
    blocks_used, blocks_cached: held blocks, and blocks in the prefix cache
        (held or free); free blocks are ``num_blocks - blocks_used``.
    steps: the last :data:`NUM_RECENT_STEPS` steps, oldest first.
    budget: the scheduler's token budget per step (``max_num_batched_tokens``).
    prefill_cap: ``max_prefill_tokens_while_decoding``, or None.
    output_tok_s, computed_tok_s: generated and computed tokens per second
        over the last few seconds.
    ttft, itl: time to first token and inter-token latency percentiles
        (seconds) over recent requests and tokens; None before any.
    spec: speculative decoding's figures; None while it is off.
    disk: the prefix cache's disk tier; None without one.
    """

    time: float
    layout: Literal["exact", "simulated"]
    num_blocks: int
    block_size: int
    requests: list[RequestState]
    num_running: int
    num_waiting: int
    num_waiting_unlisted: int
    cached_free: list[int]
    blocks_used: int
    blocks_cached: int
    steps: list[StepState]
    num_steps: int
    num_preemptions: int
    budget: int
    prefill_cap: int | None
    output_tok_s: float
    computed_tok_s: float
    ttft: Percentiles | None
    itl: Percentiles | None
    spec: SpecState | None
    disk: DiskTierState | None


def block_runs(block_ids: Iterable[int]) -> list[int]:
    """``[5, 6, 7, 20, 21]`` -> ``[5, 3, 20, 2]``: consecutive ids as (first, count) pairs."""
    runs: list[int] = []
    for block_id in block_ids:
        if runs and runs[-2] + runs[-1] == block_id:
            runs[-1] += 1
        else:
            runs += (block_id, 1)
    return runs


def request_phase(sequence: SequenceView) -> Phase:
    """Where a live sequence stands, read from its status and computed tokens."""
    if sequence.status == RequestStatus.PREEMPTED:
        return "preempted"
    if sequence.status != RequestStatus.RUNNING:
        return "waiting"
    # A running sequence with more than its next token left to compute is in a
    # prompt (or recomputing one after a preemption); otherwise it decodes.
    if sequence.num_tokens - sequence.num_computed_tokens > 1:
        return "prefilling"
    return "decoding"


def request_state(sequence: SequenceView, now: float) -> RequestState:
    """The frame's entry for a live sequence; ``now`` on the clock of its arrival time."""
    return RequestState(
        id=sequence.request_id,
        phase=request_phase(sequence),
        prompt_tokens=sequence.num_prompt_tokens,
        output_tokens=sequence.num_output_tokens,
        computed_tokens=sequence.num_computed_tokens,
        age_s=round(max(now - sequence.arrival_time, 0.0), 3),
        preemptions=sequence.num_preemptions,
        blocks=block_runs(sequence.block_ids),
    )


def spec_state(
    proposed: int,
    accepted: int,
    rates: tuple[float, float],
    adaptive: bool | None,
    declined: int | None,
) -> SpecState:
    """The frame's speculation entry from the totals since the start and the recent
    (proposed, accepted) tokens per second."""
    proposed_tok_s, accepted_tok_s = rates
    return SpecState(
        proposed=proposed,
        accepted=accepted,
        proposed_tok_s=round(proposed_tok_s, 2),
        accepted_tok_s=round(accepted_tok_s, 2),
        acceptance=round(accepted / proposed, 4) if proposed else None,
        adaptive=adaptive,
        declined=declined,
    )


def disk_tier_state(report: StepReport) -> DiskTierState | None:
    """The frame's disk tier entry from a live step report; None without a disk tier."""
    if report.disk_tier is None:
        return None
    counters = report.disk_tier.counters
    return DiskTierState(
        query_tokens=report.prefix_cache_queries,
        pool_hit_tokens=report.prefix_cache_hits,
        disk_hits=counters.hits,
        loads=counters.loads,
        writes=counters.writes,
        evictions=counters.evictions,
        bytes_read=counters.bytes_read,
        bytes_written=counters.bytes_written,
        num_bytes=report.disk_tier.num_bytes,
        enabled=report.disk_tier.enabled,
    )
