"""What crosses from callers' event loops to the async engine's loop thread.

A caller validates its request into a :class:`PreparedRequest` and queues it
as an :class:`AddCommand`; closing a stream queues an :class:`AbortCommand`.
The :class:`CommandInbox` holds them under a lock until the loop thread takes
them between steps, and refuses an add at once when the engine is dead or
when its sequences would take the waiting queue past its limit: this is the
only state both sides of the thread boundary touch, so it lives apart from
the loop that drains it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.engine.async_errors import EngineDeadError, EngineOverloadedError
from kvserve.engine.output_stream import OutputStream
from kvserve.errors import InvalidParameterError
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready to queue. pooling: set for an embedding request
    (``params`` are then the defaults, unused)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    pooling: PoolingParams | None = None


@dataclass(frozen=True)
class AddCommand:
    """One ``generate`` call: its requests, all added or none, and the stream of their deltas."""

    requests: list[PreparedRequest]
    stream: OutputStream

    @property
    def num_sequences(self) -> int:
        return sum(request.params.n for request in self.requests)


@dataclass(frozen=True)
class AbortCommand:
    """Requests to abort (ids the loop does not know are ignored)."""

    request_ids: list[str]


Command = AddCommand | AbortCommand


class CommandInbox:
    """The commands the loop thread has not taken yet, and the waiting limit they must fit.

    max_waiting_requests: the most sequences waiting for their first step (in
        add commands not applied yet, or in the engine's queue).
    wake: set whenever a command arrives; the loop thread sleeps on it when it
        has nothing to step.
    """

    def __init__(self, max_waiting_requests: int) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.wake = threading.Event()
        self._lock = threading.Lock()  # guards _commands, _num_pending, _dead
        self._commands: list[Command] = []
        self._num_pending = 0  # sequences in add commands the loop has not applied yet
        self._num_engine_waiting = 0  # published by the loop thread
        self._dead: EngineDeadError | None = EngineDeadError("not started")

    @property
    def is_open(self) -> bool:
        """Whether adds are accepted (the loop thread was started and has not stopped)."""
        return self._dead is None

    def open(self) -> None:
        """Accept adds from now on; called as the loop thread starts."""
        self._dead = None

    def submit(self, command: AddCommand) -> None:
        """Queue ``command`` and wake the loop, or refuse it with nothing queued.

        Raises InvalidParameterError when the call alone has more sequences
        than may ever wait, EngineDeadError when the loop is not running and
        EngineOverloadedError when too many sequences are waiting already.
        """
        limit = self.max_waiting_requests
        if command.num_sequences > limit:
            # It could never be admitted: "retry later" would be a lie.
            raise InvalidParameterError(
                "n", f"the request has {command.num_sequences} sequences; at most {limit} may wait"
            )
        with self._lock:
            if self._dead is not None:
                raise self._dead.fresh()
            # The call's own sequences count: an n=8 call must not take the queue past the limit.
            num_waiting = self._num_pending + self._num_engine_waiting
            if num_waiting + command.num_sequences > limit:
                raise EngineOverloadedError(
                    f"{num_waiting} sequences are waiting and this request adds "
                    f"{command.num_sequences} (limit {limit})"
                )
            self._num_pending += command.num_sequences
            self._commands.append(command)
        self.wake.set()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Queue an abort of ``request_ids`` and wake the loop."""
        with self._lock:
            self._commands.append(AbortCommand(list(request_ids)))
        self.wake.set()

    # The methods below are called by the loop thread only.

    def take(self) -> list[Command]:
        """The queued commands, in arrival order; the inbox is empty after."""
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def applied(self, command: AddCommand, num_engine_waiting: int) -> None:
        """``command``'s sequences moved from pending to the engine's queue, now this long."""
        with self._lock:
            self._num_pending -= command.num_sequences
            self._num_engine_waiting = num_engine_waiting

    def set_num_engine_waiting(self, num_engine_waiting: int) -> None:
        """Publish the engine queue's length after an iteration, for the waiting limit."""
        self._num_engine_waiting = num_engine_waiting

    def close(self, dead: EngineDeadError) -> None:
        """Refuse every later add with ``dead``; the adds still queued get it on their stream."""
        with self._lock:
            self._dead = dead
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, AddCommand):
                command.stream.put(dead.fresh())
