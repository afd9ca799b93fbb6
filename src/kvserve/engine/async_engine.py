"""AsyncEngine: the LLMEngine's step loop on a background thread, an asyncio stream per call.

The engine is not thread-safe, so one thread, the loop thread, is the only one
that touches it. Callers on the event loop first validate (:meth:`tokenize`,
:meth:`prepare`: reading the tokenizer and fixed limits changes nothing), so
a bad request fails at once and nothing is queued. Then :meth:`generate`
queues an "add" command and wakes the loop; closing its stream early
queues an "abort". The loop applies commands between steps, steps while
there is work and sleeps on an Event when there is none.

A step that raises fails the requests it was computing, with the error sent
to their streams; waiting requests and later ones are served as usual. A
request that fails by itself within a step (its sampling, its text) fails
alone, the same way. The details go to the log under an error id; the
streams get only the id.

Two engines served side by side (a generator and an embedding model) share
one loop thread: the second is built with ``share_thread_with`` the first,
and each turn of the loop runs one iteration of each. Their steps then never
overlap, each has every core, and there is one OpenMP team, not two (two
teams make the runtime stop spinning between kernels, which slows every
step: see ``own_thread.py``).

The commands and the waiting limit are in ``async_commands.py`` (the state
both threads share), the requests' streams and what each step owes them in
``output_router.py``; this module is the loop and the interface callers use,
:class:`~kvserve.engine.engine_client.EngineClient`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures

import torch

from kvserve.distributed.group import TensorParallelError
from kvserve.engine.async_commands import AddCommand, CommandInbox, PreparedRequest
from kvserve.engine.async_errors import EngineDeadError, RequestFailedError
from kvserve.engine.engine_client import EngineLimits, PromptType, TokenizedPrompt
from kvserve.engine.iteration_stats import IterationStats
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.output_router import OutputRouter
from kvserve.engine.output_stream import OutputStream, RequestStream
from kvserve.errors import new_error_id
from kvserve.kernels.heap import HeapReleaser
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.structured import CompiledGrammar

logger = logging.getLogger(__name__)

StatsObserver = Callable[[IterationStats], None]


class AsyncEngine:
    """Runs ``engine`` on a background thread; ``await``-able streams of deltas per call.

    An :class:`~kvserve.engine.engine_client.EngineClient`; ``engine`` is its own, for
    the code that built it (the server's metrics, the dashboard), never for a front.

    max_waiting_requests: the most sequences waiting for their first step; a
        call whose sequences would take them past it is refused with
        :class:`EngineOverloadedError`.
    stats_observer: called on the loop thread after each iteration.
    share_thread_with: another AsyncEngine whose loop thread runs this one's
        iterations too (start this one after it; stopping either stops both).
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = 256,
        stats_observer: StatsObserver | None = None,
        share_thread_with: AsyncEngine | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.limits: EngineLimits = engine.limits
        self.max_model_len = engine.max_model_len
        self.stats_observer = stats_observer
        self._inbox = CommandInbox(max_waiting_requests)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._router = OutputRouter()  # loop thread only
        self.num_iterations = 0  # loop iterations; it stays put while the loop sleeps
        # The engines this loop thread iterates (itself first), and the one whose thread
        # runs this one, if another's does.
        self._members: list[AsyncEngine] = [self]
        self._leader = share_thread_with
        if share_thread_with is not None:
            self._inbox.wake = share_thread_with._inbox.wake  # any command wakes the one loop
            share_thread_with._members.append(self)

    # ---------------------------------------------------------- life cycle

    def start(self) -> None:
        """Start the loop thread."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was called twice")
        self._inbox.open()
        if self._leader is not None:
            self._thread = self._leader._thread  # None until the leader starts
            return
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current step; open streams get EngineDeadError.

        Once the loop has stopped, the engine's tensor-parallel ranks are stopped too.
        An engine on another's thread stops that thread (and so the other engine) too.
        """
        if self._leader is not None:
            self._leader.shutdown(timeout)
            self._thread = self._leader._thread
        self._stopping = True
        self._inbox.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()

    @property
    def max_waiting_requests(self) -> int:
        """The most sequences that may wait for their first step (the inbox enforces it)."""
        return self._inbox.max_waiting_requests

    @property
    def is_healthy(self) -> bool:
        thread = self._leader._thread if self._leader is not None else self._thread
        return self._inbox.is_open and thread is not None and thread.is_alive()

    # ------------------------------------------------- called on the event loop

    def tokenize(self, prompt: PromptType) -> TokenizedPrompt:
        """The prompt's text (if given as text) and token ids; raises InvalidParameterError."""
        return self.engine.validator.tokenize_prompt(prompt)

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Check that the request can run (InvalidParameterError if not); queue nothing.

        cache_salt: only requests with the same salt share prefix-cache blocks.
        """
        return self.engine.validator.prepare(
            request_id, prompt_token_ids, params, prompt, cache_salt
        )

    def prepare_embedding(
        self, request_id: str, prompt: PromptType, pooling: PoolingParams, param: str = "prompt"
    ) -> PreparedRequest:
        """An embedding request, checked (InvalidParameterError if not); queue nothing."""
        return self.engine.validator.prepare_embedding(request_id, prompt, pooling, param)

    def compile_grammar(self, params: SamplingParams) -> futures.Future[CompiledGrammar] | None:
        """The compile of ``params``' grammar (None without one); thread-safe, cached."""
        return self.engine.validator.compile_grammar(params)

    def generate(self, requests: Sequence[PreparedRequest]) -> RequestStream:
        """Queue ``requests`` now; their deltas arrive on the returned stream.

        Raises EngineOverloadedError or EngineDeadError (nothing queued), or
        InvalidParameterError when the call has more sequences than may ever
        wait. The stream raises RequestFailedError when a step fails on its requests.
        Must be called on the event loop that will read the stream.
        """
        queue = OutputStream(asyncio.get_running_loop())
        self._inbox.submit(AddCommand(list(requests), queue))
        return RequestStream(queue, {request.request_id for request in requests}, self.abort)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); blocks are freed before the next step."""
        self._inbox.abort(request_ids)

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        # OpenMP's thread count is per thread: the loop's kernels use the cores the
        # runner chose, as they would on the thread that built it.
        torch.set_num_threads(self.engine.runner.num_threads)
        try:
            heap = HeapReleaser()
            while not self._stopping:
                self._inbox.wake.clear()  # before taking commands, so a later set() is never lost
                busy = any([member._iterate() for member in self._members])
                heap.after_iteration(busy)
                if not busy:
                    self._inbox.wake.wait()
            dead = EngineDeadError("shut down")
        except Exception:  # a bug in the loop itself: nothing can be served any more
            error_id = new_error_id()
            logger.exception("error %s: the engine loop failed", error_id)
            dead = EngineDeadError("the engine loop failed", error_id)
        for member in self._members:
            member._inbox.close(dead)
            member._router.close(dead)

    def _iterate(self) -> bool:
        """One iteration: commands, a step if there is work, the report; True while busy."""
        self.num_iterations += 1
        stats = self._new_stats()
        self._apply_commands(stats)
        if self.engine.has_unfinished_requests():
            self._step(stats)
        self._report(stats)
        return self.engine.has_unfinished_requests()

    def _new_stats(self) -> IterationStats:
        manager = self.engine.kv_cache_manager
        return IterationStats(
            num_running=self.engine.scheduler.num_running,
            num_waiting=self.engine.scheduler.num_waiting,
            num_kv_blocks_used=manager.num_usable_blocks - manager.num_free_blocks,
            num_kv_blocks_total=manager.num_usable_blocks,
        )

    def _apply_commands(self, stats: IterationStats) -> None:
        for command in self._inbox.take():
            if isinstance(command, AddCommand):
                self._add(command.requests, command.stream)
                # The sequences move from pending to the engine's queue.
                self._inbox.applied(command, self.engine.scheduler.num_waiting)
            else:
                ids = [i for i in command.request_ids if i in self._router]
                self.engine.abort_request(ids)
                for request_id in ids:
                    self._router.finish(request_id, "abort", stats)

    def _add(self, requests: list[PreparedRequest], stream: OutputStream) -> None:
        added: list[str] = []
        try:
            for request in requests:
                prompt = {"prompt": request.prompt, "prompt_token_ids": request.prompt_token_ids}
                self.engine.add_request(
                    request.request_id,
                    prompt,
                    None if request.pooling is not None else request.params,
                    request.arrival_time,
                    cache_salt=request.cache_salt,
                    pooling_params=request.pooling,
                )
                added.append(request.request_id)
                self._router.track(request, stream)
        except Exception:
            # All of one call's requests run, or none: its stream ends with the error.
            # prepare() checked them, so this is a bug, never the client's input.
            error_id = new_error_id()
            logger.exception("error %s: adding requests to the engine failed", error_id)
            self.engine.abort_request(added)
            self._router.untrack(added)
            stream.put(RequestFailedError("the engine could not add this request", error_id))

    def _step(self, stats: IterationStats) -> None:
        try:
            outputs = self.engine.step()
        except TensorParallelError:
            raise  # the ranks no longer agree: no later step can run, the loop must die
        except Exception:
            error_id = new_error_id()
            logger.exception(
                "error %s: an engine step failed; failing the requests it was computing", error_id
            )
            error = RequestFailedError("the engine failed while computing this request", error_id)
            self._router.fail(self.engine.abort_running_requests(), error, stats)
            return
        stats.ran_step = True
        stats.report = self.engine.stats
        stats.num_preemptions = len(stats.report.preempted)
        num_finished_sequences = self._router.route(outputs, stats, self.engine.abort_request)
        # Sequences that finished in this step left the running set, but they ran in it.
        stats.batch_size = self.engine.scheduler.num_running + num_finished_sequences

    def _report(self, stats: IterationStats) -> None:
        after = self._new_stats()
        stats.num_running = after.num_running
        stats.num_waiting = after.num_waiting
        stats.num_kv_blocks_used = after.num_kv_blocks_used
        self._inbox.set_num_engine_waiting(after.num_waiting)
        if self.stats_observer is not None:
            try:
                self.stats_observer(stats)
            except Exception:
                logger.exception("the stats observer failed; serving goes on")
