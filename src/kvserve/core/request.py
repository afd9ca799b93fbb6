"""One sequence being generated, and its life cycle.

Progress is a single number, ``num_computed_tokens``: how many of the
request's tokens (prompt, then output) have K/V in the cache. A prefill chunk,
a decode step and a recompute after preemption all just move it forward;
there are no phase flags. The request samples a new token whenever a step
brings ``num_computed_tokens`` up to ``num_tokens``.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.core.block_hash import BlockHash
from kvserve.errors import InvalidParameterError
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.structured.state import GrammarState

# Arrival order that never ties, unlike wall-clock time.
_arrival_counter = itertools.count()


def next_arrival_order() -> int:
    """A fresh arrival order, after every one handed out so far."""
    return next(_arrival_counter)


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Something the engine did for this request alone raised (its sampling, its
    # detokenizing); the other requests of the step went on.
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """How the request ended: OpenAI's ``stop``, ``length``, ``abort``, or ``error``."""
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A prompt, its sampling parameters, and the tokens generated so far.

    ``seed`` is the effective per-sequence seed (for ``n > 1`` the engine
    derives one per sequence); ``eos_token_ids`` are the model's end tokens.
    ``priority``: lower runs first under the ``priority`` policy.
    ``cache_salt``: only requests with the same salt share prefix-cache blocks.
    ``pooling_params``: set for an embedding request, which computes its prompt
    in one step and returns a pooled vector instead of sampling (see
    ``scheduler.py``); its ``sampling_params`` are then unused.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.pooling_params = pooling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = next_arrival_order()
        self.priority = priority
        self.cache_salt = cache_salt
        # Prefix-cache hashes of the full blocks of all_token_ids, filled in lazily.
        self.block_hashes: list[BlockHash] = []
        self.output_token_ids: list[int] = []
        # Prompt then output: the sequence whose K/V the cache holds a prefix of.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # The stop token id or stop string that ended the request, if any.
        self.stop_reason: int | str | None = None
        # Structured outputs: where the output stands in its grammar; None when
        # unconstrained, and again once finished (which frees the state).
        self.grammar: GrammarState | None = None
        # True when the request stopped because its grammar was complete: unlike
        # an EOS or stop token, the last token is part of the text.
        self.grammar_completed = False
        # Prompt logprobs to compute (top-k; None: none). The n sequences of one
        # prompt share them: only the first computes them (``request_group.py``).
        self.num_prompt_logprobs = None if pooling_params else sampling_params.prompt_logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The longest this request can grow: prompt plus max_tokens (an embedding
        request's prompt alone)."""
        if self.pooling_params is not None:
            return self.num_prompt_tokens
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_pooling(self) -> bool:
        """An embedding request: computed whole in one step, pooled, never sampled."""
        return self.pooling_params is not None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_output_tokens_after(self, num_output_tokens: int) -> None:
        """Forget the output tokens past the first ``num_output_tokens`` (a finished
        request whose stop string ended it before the last token a step verified)."""
        num_dropped = self.num_output_tokens - num_output_tokens
        if num_dropped > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[-num_dropped:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def check_priority_and_salt(priority: object, cache_salt: object, policy: str) -> None:
    """Raise, naming the parameter, unless both are valid for the scheduling ``policy``."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidParameterError("priority", f"must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise InvalidParameterError(
            "priority", f"is {priority}, but the scheduling policy is {policy!r}, not 'priority'"
        )
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidParameterError(
            "cache_salt", f"must be a non-empty string or None, got {cache_salt!r}"
        )
