"""What the scheduler hands the worker for one step: requests and how far each goes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    num_new_tokens: tokens computed this step, starting at
        ``request.num_computed_tokens``.
    block_ids: the request's whole block table of each KV cache group (in the
        manager's group order) after this step's allocation; one list for a
        model with a single attention type.
    samples: the chunk reaches the request's last known token, so the step
        samples a new one.
    is_decode: the step computes a single generated token (rather than prompt
        tokens, or tokens recomputed after a preemption), possibly followed by
        proposals; for statistics.
    spec_token_ids: speculative proposals to verify, the last tokens of the
        chunk (counted in ``num_new_tokens``, not yet in the request's tokens);
        empty without speculation.
    """

    request: Request
    num_new_tokens: int
    block_ids: tuple[list[int], ...]
    samples: bool
    is_decode: bool = False
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What the next forward pass computes, in flat-batch order.

    preempted_request_ids: the requests preempted while this step was
        scheduled, in the order they were preempted (none of them is in
        ``scheduled``).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted_request_ids)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled if item.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_num_scheduled_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
