"""A typed snapshot of the engine after a step: queues, KV blocks, prefix cache, work done.

The server's ``/metrics`` and the benchmarks read it; counters marked
cumulative only grow over the engine's life, the rest describe the moment
(or the step just run).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.scheduler import Scheduler
from kvserve.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after its latest step.

    num_steps: forward passes run so far (cumulative).
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
    num_scheduled_tokens: tokens computed by the latest step, split into
        num_prefill_tokens (prompt tokens, or tokens recomputed after a
        preemption) and num_decode_tokens (one generated token per sequence).
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


def collect_stats(scheduler: Scheduler, output: SchedulerOutput, num_steps: int) -> EngineStats:
    """Snapshot ``scheduler`` after it applied ``output`` (the step just run)."""
    kv = scheduler.kv_cache_manager
    return EngineStats(
        num_steps=num_steps,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        num_blocks_total=kv.num_usable_blocks,
        num_blocks_used=kv.num_usable_blocks - kv.num_free_blocks,
        num_blocks_free=kv.num_free_blocks,
        num_blocks_cached=kv.num_cached_blocks,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions_total,
        num_scheduled_tokens=output.total_num_scheduled_tokens,
        num_prefill_tokens=output.num_prefill_tokens,
        num_decode_tokens=output.num_decode_tokens,
    )
