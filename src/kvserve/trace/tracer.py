"""Recording a step trace: the engine's tracer and where its records go.

``engine.set_trace(sink)`` gives an :class:`~kvserve.engine.LLMEngine` a
:class:`StepTracer`; at the end of every step the engine hands it the
step's :class:`SchedulerOutput`, and the tracer turns that into one
:class:`StepRecord` for the sink: a :class:`TraceFile` (one JSON line per
record) or a :class:`TraceMemory` (a list, for demos and tests).

The step loop must not slow down: with no tracer the engine pays one
``None`` check per step; with one, a dict per scheduled request and one
``json.dumps`` per step, written through a buffered file that is flushed
at most once a second (so a trace of a running server stays nearly current).
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.errors import InvalidParameterError
from kvserve.trace.records import (
    TRACE_FORMAT_VERSION,
    FinishedEntry,
    Phase,
    RunHeader,
    ScheduledEntry,
    StepRecord,
)

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

TraceRecord = RunHeader | StepRecord


class TraceSink(ABC):
    """Where trace records go. One sink may serve several engines, one run each.

    origin: the ``time.perf_counter()`` value that trace times count from.
    """

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self._num_runs = 0

    def new_run(self) -> int:
        """The index of a new run in this trace."""
        run = self._num_runs
        self._num_runs += 1
        return run

    @abstractmethod
    def write(self, record: TraceRecord) -> None:
        """Store one record."""

    @abstractmethod
    def close(self) -> None:
        """Finish the trace; later records are dropped."""

    def __enter__(self) -> TraceSink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class TraceMemory(TraceSink):
    """Keeps the records in :attr:`records`, in the order they were written."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[TraceRecord] = []
        self._closed = False

    def write(self, record: TraceRecord) -> None:
        if not self._closed:
            self.records.append(record)

    def close(self) -> None:
        self._closed = True

    def steps(self, run: int | None = None) -> list[StepRecord]:
        """The step records, of every run or of ``run`` alone."""
        return [
            record
            for record in self.records
            if record["kind"] == "step" and (run is None or record["run"] == run)
        ]


class TraceFile(TraceSink):
    """Writes one JSON line per record to ``path`` (replacing the file).

    Safe to close from another thread than the one writing (a server's
    engine loop): a record that arrives after :meth:`close` is dropped.
    """

    def __init__(self, path: str | Path, flush_interval_s: float = 1.0) -> None:
        super().__init__()
        self.path = Path(path)
        try:
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115  # closed by close()
        except OSError as exc:
            raise InvalidParameterError("trace", f"cannot write {str(self.path)!r}: {exc}") from exc
        self._flush_interval_s = flush_interval_s
        self._last_flush = self.origin
        self._lock = threading.Lock()
        self._closed = False

    def write(self, record: TraceRecord) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._closed:
                return
            self._file.write(line)
            now = time.perf_counter()
            if now - self._last_flush >= self._flush_interval_s:
                self._file.flush()
                self._last_flush = now

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._file.close()


class StepTracer:
    """Turns each step of one engine into a :class:`StepRecord` for ``sink``.

    Built by ``LLMEngine.set_trace``; writes the run's :class:`RunHeader` at once.
    """

    def __init__(self, sink: TraceSink, engine: LLMEngine) -> None:
        self.sink = sink
        self.run = sink.new_run()
        self.num_steps = 0
        self._scheduler = engine.scheduler
        self._kv = engine.kv_cache_manager
        scheduler_config = engine.config.scheduler_config
        header: RunHeader = {
            "kind": "run",
            "format": TRACE_FORMAT_VERSION,
            "run": self.run,
            "model": engine.config.model_config.model,
            "block_size": self._kv.block_size,
            "num_blocks": self._kv.num_usable_blocks,
            "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
            "max_num_seqs": scheduler_config.max_num_seqs,
            "enable_chunked_prefill": scheduler_config.enable_chunked_prefill,
            "max_prefill_tokens_while_decoding": (
                scheduler_config.max_prefill_tokens_while_decoding
            ),
            "policy": scheduler_config.policy,
            "enable_prefix_caching": self._kv.enable_caching,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        sink.write(header)

    def record_step(self, output: SchedulerOutput, started: float, num_blocks_used: int) -> None:
        """Record a step that has run.

        output: what the step computed; its requests have been advanced already.
        started: ``time.perf_counter()`` when the step began.
        num_blocks_used: KV blocks held after scheduling, while the forward pass ran.
        """
        ended = time.perf_counter()
        scheduled: list[ScheduledEntry] = []
        finished: list[FinishedEntry] = []
        for item in output.scheduled:
            request = item.request
            phase: Phase
            if item.is_decode:
                phase = "decode"
            elif request.num_preemptions:
                phase = "recompute"
            else:
                phase = "prefill"
            # The step advanced num_computed_tokens by its share; the engine is the
            # only writer, so nothing else moved it in between.
            scheduled.append(
                {
                    "id": request.request_id,
                    "phase": phase,
                    "start": request.num_computed_tokens - item.num_new_tokens,
                    "tokens": item.num_new_tokens,
                    "partial": not item.samples,
                    "prompt_len": request.num_prompt_tokens,
                }
            )
            if request.is_finished:
                finished.append(
                    {
                        "id": request.request_id,
                        "reason": request.status.finish_reason,
                        "prompt_len": request.num_prompt_tokens,
                        "output_len": request.num_output_tokens,
                    }
                )
        num_blocks = self._kv.num_usable_blocks
        origin = self.sink.origin
        record: StepRecord = {
            "kind": "step",
            "run": self.run,
            "step": self.num_steps,
            "start_s": round(started - origin, 6),
            "end_s": round(ended - origin, 6),
            "num_tokens": output.total_num_scheduled_tokens,
            "scheduled": scheduled,
            "preempted": list(output.preempted_request_ids),
            "finished": finished,
            "blocks_used": num_blocks_used,
            "blocks_free": num_blocks - num_blocks_used,
            "blocks_cached": self._kv.num_cached_blocks,
            "num_running": self._scheduler.num_running,
            "num_waiting": self._scheduler.num_waiting,
        }
        self.num_steps += 1
        self.sink.write(record)
