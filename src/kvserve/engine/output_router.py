"""The async engine's table of queued requests: each step's outputs to the right streams.

The loop thread records every request it adds to the engine here, with the
stream its deltas go to. After a step, :meth:`OutputRouter.route` turns each
output into a delta for its stream and adds its tokens and latencies to the
iteration's stats. A failure is translated on the way: the details go to the
log under an error id, the stream gets a :class:`RequestFailedError` holding
only the id. Only the loop thread touches a router, so it needs no lock; it
is apart from the loop because it is the per-request half of the work (what
one request is owed), while the loop decides what runs and when.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.async_errors import EngineDeadError, RequestFailedError
from kvserve.engine.iteration_stats import IterationStats
from kvserve.engine.output_stream import DeltaTracker, OutputStream, TrackedRequest
from kvserve.errors import new_error_id
from kvserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OutputRouter:
    """The requests the loop thread added to the engine and has not finished yet."""

    def __init__(self) -> None:
        self._tracked: dict[str, TrackedRequest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def track(self, request: PreparedRequest, stream: OutputStream) -> None:
        """Send ``request``'s deltas to ``stream`` from now on (it was just added to the engine)."""
        self._tracked[request.request_id] = TrackedRequest(
            stream,
            DeltaTracker(request.params),
            len(request.prompt_token_ids),
            request.arrival_time,
        )

    def untrack(self, request_ids: Iterable[str]) -> None:
        """Forget requests without a word to their stream (their add was undone)."""
        for request_id in request_ids:
            del self._tracked[request_id]

    def finish(self, request_id: str, reason: str, stats: IterationStats) -> None:
        """Forget a request that ended (for ``reason``); its numbers go to ``stats``."""
        stats.finished.append(self._tracked.pop(request_id).finished(reason))

    def fail(
        self, request_ids: Iterable[str], error: RequestFailedError, stats: IterationStats
    ) -> None:
        """End those of ``request_ids`` still tracked with ``error`` on their stream."""
        for request_id in request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                tracked.stream.put(error.fresh())
                self.finish(request_id, "error", stats)

    def route(
        self, outputs: list[RequestOutput], stats: IterationStats, abort: Callable[[str], None]
    ) -> int:
        """Hand each tracked request's step output to its stream as a delta.

        A request that failed alone in the step, or whose delta could not be
        built (then ``abort`` stops it in the engine), gets a
        RequestFailedError instead; the others go on. Returns how many
        sequences finished in the step.
        """
        num_finished_sequences = 0
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.error is not None:
                # It failed alone and is finished already; the others in the step go on.
                error_id = new_error_id()
                logger.error(
                    "error %s: request %s failed alone: %s",
                    error_id,
                    output.request_id,
                    output.error,
                )
                tracked.stream.put(
                    RequestFailedError("the engine failed while computing this request", error_id)
                )
                self.finish(output.request_id, "error", stats)
                continue
            try:
                delta = tracked.tracker.delta(output)
            except Exception:
                error_id = new_error_id()
                logger.exception(
                    "error %s: turning request %s's output into a delta failed",
                    error_id,
                    output.request_id,
                )
                abort(output.request_id)
                tracked.stream.put(RequestFailedError("preparing this output failed", error_id))
                self.finish(output.request_id, "error", stats)
                continue
            num_finished_sequences += sum(d.finish_reason is not None for d in delta.outputs)
            tracked.observe(output.metrics, delta, stats)
            tracked.stream.put(delta)
            if output.finished:
                reason = output.outputs[0].finish_reason or "stop"
                self.finish(output.request_id, reason, stats)
        return num_finished_sequences

    def close(self, dead: EngineDeadError) -> None:
        """End every tracked request's stream with ``dead`` (the loop stopped) and forget them."""
        for tracked in self._tracked.values():
            tracked.stream.put(dead.fresh())
        self._tracked.clear()
