"""Recording a step trace: the engine's tracer and where its records go.

``engine.set_trace(sink)`` opens a run of the sink with the engine's
:class:`RunInfo` (:meth:`TraceSink.start_run`, which writes the run's header)
and gets a :class:`StepTracer` back; at the end of every step the engine hands
it the step's :class:`StepReport`, and the tracer formats that as one
:class:`StepRecord` for the sink: a :class:`TraceFile` (one JSON line per
record) or a :class:`TraceMemory` (a list, for demos and tests). The tracer
never sees the engine: the engine knows only the ``StepRecorder`` protocol
of ``core/step_report.py``.

The step loop must not slow down: with no tracer the engine pays one
``None`` check per step (its reports then leave out the per-sequence parts);
with one, a share and a dict per scheduled sequence and one ``json.dumps`` per
step, written through a buffered file that is flushed
at most once a second (so a trace of a running server stays nearly current).
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType

from kvserve.core.step_report import RunInfo, StepReport
from kvserve.errors import InvalidParameterError
from kvserve.trace.records import (
    TRACE_FORMAT_VERSION,
    FinishedEntry,
    RunHeader,
    ScheduledEntry,
    StepRecord,
)

TraceRecord = RunHeader | StepRecord


class TraceSink(ABC):
    """Where trace records go. One sink may serve several engines, one run each.

    origin: the ``time.perf_counter()`` value that trace times count from.
    """

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self._num_runs = 0

    def start_run(self, info: RunInfo, baseline: StepReport | None = None) -> StepTracer:
        """Open a new run of this trace for an engine with settings ``info`` (its header is
        written at once); the engine gives the returned tracer every step's report.
        ``baseline``: the engine's last report before the run, whose cumulative counters
        the first record's shares are counted from."""
        run = self._num_runs
        self._num_runs += 1
        return StepTracer(self, run, info, baseline)

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
    """Formats each step report of one engine's run as a :class:`StepRecord` for ``sink``.

    Built by :meth:`TraceSink.start_run`, which numbers the run; writes the
    run's :class:`RunHeader` at once. Steps are numbered from 0 in each run.
    """

    def __init__(
        self, sink: TraceSink, run: int, info: RunInfo, baseline: StepReport | None = None
    ) -> None:
        self.sink = sink
        self.run = run
        self.num_steps = 0
        self._num_blocks = info.num_blocks
        # The reports' speculation and disk-tier counters are cumulative; a record holds its
        # step's share, counted from the engine's totals when the run started.
        before = baseline or StepReport()
        self._spec_seen = (before.num_spec_proposed_tokens, before.num_spec_accepted_tokens)
        disk = before.disk_tier.counters if before.disk_tier is not None else None
        self._disk_seen = (disk.loads, disk.writes) if disk is not None else (0, 0)
        header: RunHeader = {
            "kind": "run",
            "format": TRACE_FORMAT_VERSION,
            "run": run,
            "model": info.model,
            "block_size": info.block_size,
            "num_blocks": info.num_blocks,
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "max_num_seqs": info.max_num_seqs,
            "enable_chunked_prefill": info.enable_chunked_prefill,
            "max_prefill_tokens_while_decoding": info.max_prefill_tokens_while_decoding,
            "policy": info.policy,
            "enable_prefix_caching": info.enable_prefix_caching,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        sink.write(header)

    def record_step(self, report: StepReport) -> None:
        """Write the record of a step that has run (see :class:`StepReport`).

        The engine fills the report's per-sequence parts while a tracer is attached.
        """
        assert report.scheduled is not None and report.finished is not None
        scheduled: list[ScheduledEntry] = [
            {
                "id": share.request_id,
                "phase": share.phase,
                "start": share.start,
                "tokens": share.num_tokens,
                "partial": share.partial,
                "prompt_len": share.num_prompt_tokens,
            }
            for share in report.scheduled
        ]
        finished: list[FinishedEntry] = [
            {
                "id": share.request_id,
                "reason": share.finish_reason,
                "prompt_len": share.num_prompt_tokens,
                "output_len": share.num_output_tokens,
            }
            for share in report.finished
        ]
        origin = self.sink.origin
        seen_proposed, seen_accepted = self._spec_seen
        self._spec_seen = (report.num_spec_proposed_tokens, report.num_spec_accepted_tokens)
        record: StepRecord = {
            "kind": "step",
            "run": self.run,
            "step": self.num_steps,
            "start_s": round(report.started - origin, 6),
            "end_s": round(report.ended - origin, 6),
            "num_tokens": report.num_scheduled_tokens,
            "scheduled": scheduled,
            "preempted": list(report.preempted),
            "finished": finished,
            "blocks_used": report.num_blocks_used_in_step,
            "blocks_free": self._num_blocks - report.num_blocks_used_in_step,
            "blocks_cached": report.num_blocks_cached,
            "num_running": report.num_running,
            "num_waiting": report.num_waiting,
            "spec_proposed": report.num_spec_proposed_tokens - seen_proposed,
            "spec_accepted": report.num_spec_accepted_tokens - seen_accepted,
        }
        if report.disk_tier is not None:
            counters = report.disk_tier.counters
            seen_loads, seen_writes = self._disk_seen
            record["disk_loads"] = counters.loads - seen_loads
            record["disk_writes"] = counters.writes - seen_writes
            self._disk_seen = (counters.loads, counters.writes)
        self.num_steps += 1
        self.sink.write(record)
