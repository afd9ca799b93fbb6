"""Reading the scheduler and the KV cache manager into the plain records of ``step_report.py``.

The one place that turns the bookkeeping's live objects into a
:class:`StepReport` (after every step) or a :class:`PoolView` (when a
picture of memory is asked for), so that no consumer reads them itself.
"""

from __future__ import annotations

from itertools import islice
from typing import NamedTuple

from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.core.step_report import (
    FinishedShare,
    PoolView,
    ScheduledShare,
    SequenceView,
    StepPhase,
    StepReport,
)


def collect_stats(
    scheduler: Scheduler,
    output: SchedulerOutput,
    num_steps: int,
    *,
    started: float = 0.0,
    ended: float = 0.0,
    num_blocks_used_in_step: int = 0,
    per_sequence: bool = False,
) -> StepReport:
    """The report of the step ``output`` describes, read after ``scheduler`` applied it.

    num_steps: forward passes run so far, this one included.
    started, ended, num_blocks_used_in_step: what the engine measured while
        stepping (see :class:`StepReport`).
    per_sequence: fill the report's ``scheduled`` and ``finished`` (a record
        per sequence of the batch; only a recorder needs them).
    """
    kv = scheduler.kv_cache_manager
    num_scheduled_tokens = output.total_num_scheduled_tokens
    num_decode_tokens = output.num_decode_tokens
    scheduled, finished = _shares(output) if per_sequence else (None, None)
    return StepReport(
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
        num_scheduled_tokens=num_scheduled_tokens,
        num_prefill_tokens=num_scheduled_tokens - num_decode_tokens,
        num_decode_tokens=num_decode_tokens,
        num_blocks_used_in_step=num_blocks_used_in_step,
        num_spec_proposed_tokens=scheduler.num_spec_proposed_total,
        num_spec_accepted_tokens=scheduler.num_spec_accepted_total,
        num_spec_declined=scheduler.num_spec_declined_total,
        started=started,
        ended=ended,
        preempted=tuple(output.preempted_request_ids),
        scheduled=scheduled,
        finished=finished,
        disk_tier=None if kv.disk_store is None else kv.disk_store.snapshot(),
    )


class _Shares(NamedTuple):
    scheduled: tuple[ScheduledShare, ...]
    finished: tuple[FinishedShare, ...]


def _shares(output: SchedulerOutput) -> _Shares:
    """Each scheduled sequence's part of the step, and those that finished in it."""
    scheduled: list[ScheduledShare] = []
    finished: list[FinishedShare] = []
    for item in output.scheduled:
        request = item.request
        phase: StepPhase
        if item.is_decode:
            phase = "decode"
        elif request.num_preemptions:
            phase = "recompute"
        else:
            phase = "prefill"
        # The step advanced num_computed_tokens by its share; the engine is the
        # only writer, so nothing else moved it in between.
        scheduled.append(
            ScheduledShare(
                request.request_id,
                phase,
                request.num_computed_tokens - item.num_new_tokens,
                item.num_new_tokens,
                not item.samples,
                request.num_prompt_tokens,
            )
        )
        if request.is_finished:
            finished.append(
                FinishedShare(
                    request.request_id,
                    request.status.finish_reason,
                    request.num_prompt_tokens,
                    request.num_output_tokens,
                )
            )
    return _Shares(tuple(scheduled), tuple(finished))


def view_pool(scheduler: Scheduler, max_waiting: int) -> PoolView:
    """The sequences and blocks of ``scheduler`` now: every running one, the first
    ``max_waiting`` waiting ones (a waiting sequence holds no blocks).

    O(running sequences' blocks + cached blocks): for occasional pictures, not every step.
    """
    kv = scheduler.kv_cache_manager
    sequences = [
        _sequence_view(request, tuple(kv.held_block_ids(request.request_id)))
        for request in scheduler.running
    ]
    sequences += [_sequence_view(request, ()) for request in islice(scheduler.waiting, max_waiting)]
    return PoolView(
        sequences=tuple(sequences),
        cached_free_block_ids=tuple(sorted(kv.block_pool.cached_free_block_ids())),
        num_blocks_used=kv.num_usable_blocks - kv.num_free_blocks,
        num_blocks_cached=kv.num_cached_blocks,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        num_preemptions=scheduler.num_preemptions_total,
    )


def _sequence_view(request: Request, block_ids: tuple[int, ...]) -> SequenceView:
    return SequenceView(
        request.request_id,
        request.status,
        request.num_prompt_tokens,
        request.num_output_tokens,
        request.num_tokens,
        request.num_computed_tokens,
        request.arrival_time,
        request.num_preemptions,
        block_ids,
    )
