"""The records of a step trace: what one line of a trace file holds.

A trace is a sequence of JSON objects, one per line. A ``run`` record opens
each run (one engine: a command that builds several engines, such as a
benchmark comparing two settings, writes several runs into one file); every
``step`` record names its run. Records are plain dicts (typed here as
``TypedDict``) so that writing one costs no more than building it.

Times are seconds since the trace sink was created, on one clock for every
run of the sink.
"""

from __future__ import annotations

from typing import Literal, TypedDict

# A scheduled entry's phase is the step report's (one list of phases for both).
from kvserve.core.step_report import STEP_PHASES as PHASES
from kvserve.core.step_report import StepPhase as Phase

__all__ = [
    "PHASES",
    "TRACE_FORMAT_VERSION",
    "FinishedEntry",
    "Phase",
    "RunHeader",
    "ScheduledEntry",
    "StepRecord",
]

# Bumped when a field changes meaning; readers refuse other versions.
TRACE_FORMAT_VERSION = 1


class RunHeader(TypedDict):
    """The first record of a run: the engine's settings.

    kind: always ``"run"``.
    format: :data:`TRACE_FORMAT_VERSION`.
    run: the run's index in its trace (0, 1, ...).
    model: the model as given to the engine.
    block_size: tokens per KV block.
    num_blocks: usable KV blocks in the pool (the null block excluded).
    max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
        max_prefill_tokens_while_decoding, policy: the scheduler's settings.
    enable_prefix_caching: whether the prefix cache is on.
    started_at: wall-clock time the run started (ISO 8601).
    """

    kind: Literal["run"]
    format: int
    run: int
    model: str
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    max_prefill_tokens_while_decoding: int | None
    policy: str
    enable_prefix_caching: bool
    started_at: str


class ScheduledEntry(TypedDict):
    """One request's share of a step.

    id: the sequence id (the request id, or ``request_id#i`` for one of n > 1).
    phase: ``decode`` (one generated token), ``prefill`` (prompt tokens), or
        ``recompute`` (tokens of a request that was preempted, computed again).
    start: the request's computed tokens before the step (the chunk covers
        token positions ``[start, start + tokens)``).
    tokens: tokens computed for it in this step.
    partial: the chunk stops short of the request's last known token, so it
        samples nothing (a prefill chunk that does not reach the end of the prompt).
    prompt_len: the request's prompt tokens.
    """

    id: str
    phase: Phase
    start: int
    tokens: int
    partial: bool
    prompt_len: int


class FinishedEntry(TypedDict):
    """A request that finished in a step.

    reason: ``stop``, ``length``, ``abort`` or ``error``.
    output_len: tokens it generated.
    """

    id: str
    reason: str | None
    prompt_len: int
    output_len: int


class _StepRecordFields(TypedDict):
    """The fields every step record has (see :class:`StepRecord`)."""

    kind: Literal["step"]
    run: int
    step: int
    start_s: float
    end_s: float
    num_tokens: int
    scheduled: list[ScheduledEntry]
    preempted: list[str]
    finished: list[FinishedEntry]
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    num_running: int
    num_waiting: int


class StepRecord(_StepRecordFields, total=False):
    """One engine step (one forward pass).

    kind: always ``"step"``.
    run: the run it belongs to.
    step: the step's index in its run (0, 1, ...).
    start_s, end_s: when the step began and ended (seconds since the trace started).
    num_tokens: tokens computed in the step (the sum of ``scheduled``).
    scheduled: the requests in the forward pass, in flat-batch order.
    preempted: requests preempted while the step was scheduled.
    finished: requests that finished in the step.
    blocks_used, blocks_free: KV blocks held by requests and not held, while
        the forward pass ran (after scheduling); used + free = the run's num_blocks.
    blocks_cached: blocks in the prefix cache after the step (held or free).
    num_running, num_waiting: sequences running and waiting after the step.
    spec_proposed, spec_accepted: speculative tokens verified in this step, and
        how many of them were accepted (0 without ``speculative_config``).
        Every trace this kvserve writes has them; traces written before
        speculative decoding existed do not, and readers take them as 0.
    disk_loads, disk_writes: KV blocks the prefix cache's disk tier read back
        into the pool and wrote to disk since the previous step; only with a
        disk tier (``prefix_cache_dir``), and taken as 0 where absent.
    """

    spec_proposed: int
    spec_accepted: int
    disk_loads: int
    disk_writes: int
