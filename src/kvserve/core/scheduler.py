"""Continuous batching: which requests run in the next forward pass, and how far.

Each step has a token budget (``max_num_batched_tokens``) and a request cap
(``max_num_seqs``). The scheduler fills it in three passes:

1. running requests that need a single token (decodes) — they are cheap and
   a user is waiting on each of them;
2. running requests still working through their prompt (chunked prefill);
3. waiting requests, in arrival order, as long as budget, seats and blocks last.

Every scheduled request gets ``num_new_tokens``: how many of its not yet
computed tokens this step covers. A chunk that reaches the end of the
request's known tokens makes it sample one new token.

When the pool runs out of blocks for a running request, the newest running
request is preempted: its blocks are freed, its generated tokens kept, and it
goes back to the front of the waiting queue to be recomputed later.

Pure Python: no tensors here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    num_new_tokens: tokens computed this step, starting at
        ``request.num_computed_tokens``.
    block_ids: the request's whole block table after this step's allocation.
    samples: the chunk reaches the request's last known token, so the step
        samples a new one.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    samples: bool


@dataclass
class SchedulerOutput:
    """What the next forward pass computes, in flat-batch order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _StepBudget:
    """Tokens left in this step; mutated as requests are scheduled or preempted."""

    tokens: int


class Scheduler:
    """Decides each step's batch and applies its results."""

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    # ----------------------------------------------------------------- queue

    def add_request(self, request: Request) -> None:
        """Queue a request; the engine has validated it already."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string) and free their blocks at once.

        Unknown or already finished ids are ignored, so a late abort is harmless.
        """
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick the requests and token counts of the next forward pass."""
        output = SchedulerOutput()
        budget = _StepBudget(self.config.max_num_batched_tokens)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget.tokens == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older request
            self._schedule_running(request, budget, output)
        if output.num_preempted == 0:
            self._schedule_waiting(budget, output)
        return output

    def _num_new_tokens(self, request: Request, budget: _StepBudget) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if self.config.enable_chunked_prefill:
            return min(num_new, budget.tokens)
        return num_new if num_new <= budget.tokens else 0

    def _schedule_running(
        self, request: Request, budget: _StepBudget, output: SchedulerOutput
    ) -> None:
        num_new = self._num_new_tokens(request, budget)
        if num_new == 0:
            return
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = max(self.running, key=lambda r: r.arrival_order)
            self._preempt(victim, budget, output)
            if victim is request:
                return
        self._add_to_output(request, num_new, budget, output)

    def _schedule_waiting(self, budget: _StepBudget, output: SchedulerOutput) -> None:
        max_num_seqs = self.config.max_num_seqs
        while self.waiting and budget.tokens > 0 and len(self.running) < max_num_seqs:
            request = self.waiting[0]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                break
            if self.kv_cache_manager.allocate_slots(request, num_new) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_output(request, num_new, budget, output)

    def _add_to_output(
        self, request: Request, num_new: int, budget: _StepBudget, output: SchedulerOutput
    ) -> None:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        samples = request.num_computed_tokens + num_new == request.num_tokens
        output.scheduled.append(ScheduledRequest(request, num_new, block_ids, samples))
        budget.tokens -= num_new

    def _preempt(self, victim: Request, budget: _StepBudget, output: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the victim's KV, keep its tokens, requeue it first."""
        for index, item in enumerate(output.scheduled):
            if item.request is victim:
                # Already scheduled in this step: give its share of the step back.
                del output.scheduled[index]
                budget.tokens += item.num_new_tokens
                break
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        output.num_preempted += 1
        self.num_preemptions_total += 1

    # ------------------------------------------------------ after the forward

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply token-level stops.

        ``sampled_token_ids`` maps each request that sampled this step to its
        new token. Returns the requests that finished in this step (their
        blocks are already free).
        """
        finished = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in (params.stop_token_ids or ()):
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
