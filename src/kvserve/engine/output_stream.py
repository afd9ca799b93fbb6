"""Per-request output deltas and the asyncio queue that carries them.

The engine's outputs are cumulative and mutated by every step, so they must
not cross threads. The loop thread turns them into deltas (:class:`DeltaTracker`)
holding only what a stream has not been sent yet, as fresh objects, and posts
them to the caller's event loop (:class:`OutputStream`), where a
:class:`RequestStream` hands them to the caller.

Text that might be the start of a stop string is held back until the next
tokens show it is not (or the request ends): the engine cuts a stop string out
of the text once it completes, and a stream cannot take back what it sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from kvserve.engine.detokenizer import stop_prefix_len
from kvserve.engine.iteration_stats import FinishedRequestStats, IterationStats
from kvserve.outputs import PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class CompletionDelta:
    """What one completion gained since the last delta.

    ``text`` may lag ``token_ids`` (held-back text, incomplete characters);
    by the delta with a ``finish_reason`` every character has been sent.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class RequestDelta:
    """The completions of one request that changed in a step; ``finished`` once all ended."""

    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionDelta]
    finished: bool
    embedding: list[float] | None = None  # an embedding request's vector, when finished
    # With SamplingParams.prompt_logprobs: every prompt token's entry, in the first
    # delta after the whole prompt was computed (then None again).
    prompt_logprobs: PromptLogprobs | None = None


class DeltaTracker:
    """Remembers how much of each of a request's completions was already handed out."""

    def __init__(self, params: SamplingParams) -> None:
        self._stop = tuple(params.stop_strings)
        self.num_chars_sent = [0] * params.n
        self.num_tokens_sent = [0] * params.n
        self._finished = [False] * params.n
        self._prompt_logprobs_sent = False

    @property
    def num_tokens(self) -> int:
        """Tokens handed out so far, over all completions."""
        return sum(self.num_tokens_sent)

    def delta(self, output: RequestOutput) -> RequestDelta:
        """The part of ``output`` (cumulative) not handed out yet."""
        deltas = []
        for completion in output.outputs:
            index = completion.index
            if self._finished[index]:
                continue
            finished = completion.finished()
            text = completion.text
            safe_len = len(text) if finished else len(text) - stop_prefix_len(text, self._stop)
            new_text = text[self.num_chars_sent[index] : safe_len]
            first_new_token = self.num_tokens_sent[index]
            new_token_ids = completion.token_ids[first_new_token:]
            if not (new_text or new_token_ids or finished):
                continue
            logprobs = completion.logprobs
            deltas.append(
                CompletionDelta(
                    index=index,
                    text=new_text,
                    token_ids=new_token_ids,
                    logprobs=None if logprobs is None else logprobs[first_new_token:],
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
            self.num_chars_sent[index] = max(self.num_chars_sent[index], safe_len)
            self.num_tokens_sent[index] = len(completion.token_ids)
            self._finished[index] = finished
        return RequestDelta(
            output.request_id,
            len(output.prompt_token_ids),
            deltas,
            output.finished,
            output.embedding,
            self._new_prompt_logprobs(output),
        )

    def _new_prompt_logprobs(self, output: RequestOutput) -> PromptLogprobs | None:
        """The request's prompt logprobs, once they cover the prompt and were not sent."""
        held = output.prompt_logprobs
        if self._prompt_logprobs_sent or held is None:
            return None
        if len(held) < len(output.prompt_token_ids):
            return None
        self._prompt_logprobs_sent = True
        return list(held)


class OutputStream:
    """The event-loop end of one ``generate`` call; any thread may :meth:`put` into it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    def put(self, item: RequestDelta | BaseException) -> None:
        """Hand ``item`` to the consumer; safe to call from the loop thread."""
        # RuntimeError: the event loop has closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> RequestDelta | BaseException:
        return await self._queue.get()


class RequestStream:
    """The deltas of one ``AsyncEngine.generate`` call, interleaved across its requests.

    Use as ``async with engine.generate(requests) as stream: async for delta in stream``.
    Leaving the block early (break, an exception, cancellation) or calling
    :meth:`close` aborts the requests still running, which frees their blocks.
    """

    def __init__(
        self, queue: OutputStream, request_ids: set[str], abort: Callable[[set[str]], None]
    ) -> None:
        self._queue = queue
        self._unfinished = set(request_ids)
        self._abort = abort

    async def accepted(self) -> None:
        """Return once the engine has queued the requests, or raise why it refused them.

        ``AsyncEngine.generate`` queues (or refuses) before it returns, so here it
        returns at once; a remote engine's stream waits for its replica's answer.
        """

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort whatever has not finished; calling it again does nothing."""
        if self._unfinished:
            self._abort(self._unfinished)
            self._unfinished = set()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


@dataclass
class TrackedRequest:
    """The loop thread's record of one queued request: where its deltas go, and its timing."""

    stream: OutputStream
    tracker: DeltaTracker
    num_prompt_tokens: int
    arrival_time: float
    last_token_time: float | None = None

    def observe(
        self, metrics: RequestMetrics | None, delta: RequestDelta, stats: IterationStats
    ) -> None:
        """Add this step's tokens and latencies of the request to ``stats``."""
        num_new = sum(len(d.token_ids) for d in delta.outputs)
        if num_new == 0 or metrics is None or metrics.last_token_time is None:
            return
        stats.num_generation_tokens += num_new
        token_time = metrics.last_token_time
        if self.last_token_time is None:
            stats.num_prompt_tokens += self.num_prompt_tokens
            stats.time_to_first_token.append(token_time - self.arrival_time)
            scheduled = metrics.first_scheduled_time or token_time
            stats.queue_time.append(scheduled - self.arrival_time)
        else:
            stats.inter_token_latency.append(token_time - self.last_token_time)
        self.last_token_time = token_time

    def finished(self, reason: str) -> FinishedRequestStats:
        return FinishedRequestStats(
            finish_reason=reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.tracker.num_tokens,
            e2e_latency=time.monotonic() - self.arrival_time,
        )
