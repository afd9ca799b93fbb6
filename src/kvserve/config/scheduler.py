"""``SchedulerConfig``: continuous batching, what runs in each forward pass.

One of the groups :class:`~kvserve.config.engine.EngineConfig` holds; the
scheduler (``core/scheduler.py``) and its waiting queue
(``core/request_queue.py``, by ``policy``) read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvserve.config.checks import require, require_positive_int

SchedulingPolicy = Literal["fcfs", "priority"]
_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    max_num_batched_tokens: tokens (decode tokens plus prefill chunks) in one
        forward pass.
    max_num_seqs: requests in one forward pass.
    enable_chunked_prefill: split long prompts across steps so decodes keep
        flowing; when off, a prompt is prefilled whole in one step.
    max_prefill_tokens_while_decoding: in a step that also decodes, prompt
        chunks (of more than one token) take at most this many tokens together, so that a new prompt
        does not stall the streams already generating (a step with nothing to
        decode still uses all of max_num_batched_tokens). None (offline runs):
        no cap; ``kvserve serve`` uses 96. Applies with chunked prefill only.
    policy: ``fcfs`` serves requests in arrival order and, when blocks run
        out, preempts the newest running request. ``priority`` serves the
        lowest per-request ``priority`` value first (ties in arrival order)
        and preempts the running request with the largest value (ties: the
        newest), also to admit a waiting request of higher priority.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    max_prefill_tokens_while_decoding: int | None = None
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        require_positive_int(self.max_num_batched_tokens, "max_num_batched_tokens")
        require_positive_int(self.max_num_seqs, "max_num_seqs")
        if self.max_prefill_tokens_while_decoding is not None:
            require_positive_int(
                self.max_prefill_tokens_while_decoding, "max_prefill_tokens_while_decoding"
            )
        # Every running request must be able to decode in every step, or some would starve.
        require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"must be at least max_num_seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}",
        )
        require(
            self.policy in _POLICIES,
            "policy",
            f"must be one of {_POLICIES}, got {self.policy!r}",
        )
