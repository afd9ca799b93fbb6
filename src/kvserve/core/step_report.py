"""What one engine step did and what the engine holds after it, as plain frozen data.

``LLMEngine.step()`` produces one :class:`StepReport` per call (``engine.stats``
holds the latest), built by :func:`kvserve.core.stats.collect_stats`. Every
consumer formats it and nothing else: the server's Prometheus metrics, the
step trace's records, the dashboard's step bars and counters, the benchmarks'
figures. None of them reads the scheduler or the block pool for step data.

Two more records travel beside it: :class:`RunInfo`, the engine's fixed
settings, handed once to whoever formats a run (a trace's header, the
dashboard's budget line); and :class:`PoolView`, the sequences and their
blocks at one moment, which the dashboard asks for only when it draws a frame
(copying every block table on every step would cost the step loop for nothing).

Counters marked cumulative only grow over the engine's life; the rest describe
the moment after the step (or the step itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from kvserve.core.disk_store import DiskTierSnapshot
from kvserve.core.request import RequestStatus

# How a scheduled chunk relates to its request: ``decode`` (one generated
# token), ``prefill`` (prompt tokens), ``recompute`` (tokens of a request that
# was preempted, computed again).
StepPhase = Literal["prefill", "decode", "recompute"]
STEP_PHASES: tuple[StepPhase, ...] = ("prefill", "decode", "recompute")


class ScheduledShare(NamedTuple):
    """One sequence's part of a step's forward pass.

    request_id: the sequence id (the request id, or ``request_id#i`` for one of n > 1).
    start: its computed tokens before the step; the chunk covers token
        positions ``[start, start + num_tokens)``.
    partial: the chunk stops short of the sequence's last known token, so it
        sampled nothing (a prefill chunk that does not reach the prompt's end).
    """

    request_id: str
    phase: StepPhase
    start: int
    num_tokens: int
    partial: bool
    num_prompt_tokens: int


class FinishedShare(NamedTuple):
    """A sequence that finished in a step; finish_reason is ``stop``, ``length``, ``abort`` or ``error``."""

    request_id: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class RunInfo:
    """An engine's settings that never change while it runs.

    num_blocks: usable KV blocks in the pool (the null block excluded).
    max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
        max_prefill_tokens_while_decoding, policy: the scheduler's settings.
    spec_method: where speculative proposals come from (``speculative_config.method``),
        None without speculative decoding; spec_adaptive: whether the adaptive
        policy decides each request's proposals.
    """

    model: str
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    max_prefill_tokens_while_decoding: int | None
    policy: str
    enable_prefix_caching: bool
    spec_method: str | None = None
    spec_adaptive: bool = False


@dataclass(frozen=True)
class StepReport:
    """One call of ``LLMEngine.step()``: the work it did and the engine's state after it.

    num_steps: forward passes run so far, this one included (cumulative; a
        call that ran no forward pass leaves it as it was).
    num_running, num_waiting: sequences (an ``n > 1`` request counts n times).
    num_blocks_total: usable KV blocks (the null block excluded).
    num_blocks_used: blocks held by at least one sequence.
    num_blocks_free: blocks nobody holds, cached ones included (they are
        evicted on demand); ``used + free == total``.
    num_blocks_cached: blocks in the prefix cache, whether held or free.
    prefix_cache_queries, prefix_cache_hits: tokens looked up in the prefix
        cache when sequences were admitted, and how many of them were found
        (cumulative; a preempted sequence is looked up again on readmission).
    num_preemptions: sequences preempted so far (cumulative).
    num_scheduled_tokens: tokens computed by the step, split into
        num_prefill_tokens (prompt tokens, or tokens recomputed after a
        preemption) and num_decode_tokens (one generated token per sequence,
        and the speculative proposals it verifies).
    num_spec_proposed_tokens, num_spec_accepted_tokens: speculative
        proposals verified so far, and how many of them were accepted
        (cumulative; 0 without ``speculative_config``).
    num_spec_declined: decoding requests the adaptive speculation policy gave
        no proposal although their limits allowed some (cumulative).
    num_blocks_used_in_step: blocks held while the forward pass ran (after
        scheduling, before finished sequences gave theirs back).
    started, ended: ``time.perf_counter()`` when the call began and ended.
    preempted: sequences preempted while the step was scheduled.
    scheduled: the sequences of the forward pass, in flat-batch order, and
    finished: those of them that finished in it; both only while a recorder
        is attached (``LLMEngine.set_trace``), None otherwise: a record per
        sequence would cost every step of a large batch for nobody.
    disk_tier: the prefix cache's disk tier after the step: its cumulative
        counters (hits, loads, writes, evictions, bytes) and the blocks and
        bytes it holds; None without a disk tier.
    """

    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    num_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_blocks_used_in_step: int = 0
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_declined: int = 0
    started: float = 0.0
    ended: float = 0.0
    preempted: tuple[str, ...] = ()
    scheduled: tuple[ScheduledShare, ...] | None = None
    finished: tuple[FinishedShare, ...] | None = None
    disk_tier: DiskTierSnapshot | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over queried tokens, in [0, 1]; 0 before any query."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable blocks held by sequences, in [0, 1]."""
        if self.num_blocks_total == 0:
            return 0.0
        return self.num_blocks_used / self.num_blocks_total


class SequenceView(NamedTuple):
    """One sequence in a :class:`PoolView`.

    num_tokens: prompt and output tokens known so far; ``num_computed_tokens``
        of them have K/V in the cache.
    arrival_time: ``time.monotonic()`` when its request arrived.
    block_ids: the blocks it holds, every KV cache group's in turn.
    """

    request_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_output_tokens: int
    num_tokens: int
    num_computed_tokens: int
    arrival_time: float
    num_preemptions: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PoolView:
    """The engine's sequences and KV blocks at one moment (between steps).

    sequences: the running ones (in the running set's order), then waiting
        ones in queue order, at most the number asked for.
    cached_free_block_ids: blocks nobody holds that keep a cached prefix, ascending.
    num_blocks_used, num_blocks_cached, num_running, num_waiting,
        num_preemptions: as in :class:`StepReport`, at this moment.
    """

    sequences: tuple[SequenceView, ...]
    cached_free_block_ids: tuple[int, ...]
    num_blocks_used: int
    num_blocks_cached: int
    num_running: int
    num_waiting: int
    num_preemptions: int


class StepObserver(Protocol):
    """Takes the report of every step of one engine (on the thread that steps it)."""

    def record_step(self, report: StepReport) -> None:
        """Format or store ``report``; it must not raise for an ordinary report."""


class StepRecorder(Protocol):
    """Something that records runs of steps, such as a trace sink (``kvserve.trace``).

    ``LLMEngine.set_trace`` hands it the engine's :class:`RunInfo` once and
    then gives every step's report to the observer it returned; so the engine
    knows this protocol, never the trace's formats.
    """

    def start_run(self, info: RunInfo, baseline: StepReport | None = None) -> StepObserver:
        """Open a new run of an engine with settings ``info``; its steps go to the result.
        ``baseline``: the engine's last report before the run (its counters so far)."""
        ...
