"""The engine's step trace: one record per forward pass, and its Chrome trace-event form.

``engine.set_trace(TraceFile("run.jsonl"))`` (or ``--trace FILE`` on the
commands) records every step; :func:`read_trace` reads a file back;
:func:`to_chrome` converts it for Perfetto. See ``docs/trace.md``.
"""

from kvserve.trace.chrome import to_chrome
from kvserve.trace.reader import TraceRun, read_trace, runs_from_records
from kvserve.trace.records import FinishedEntry, RunHeader, ScheduledEntry, StepRecord
from kvserve.trace.tracer import StepTracer, TraceFile, TraceMemory, TraceSink

__all__ = [
    "FinishedEntry",
    "RunHeader",
    "ScheduledEntry",
    "StepRecord",
    "StepTracer",
    "TraceFile",
    "TraceMemory",
    "TraceRun",
    "TraceSink",
    "read_trace",
    "runs_from_records",
    "to_chrome",
]
