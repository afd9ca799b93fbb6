"""A step trace as Chrome trace events, for Perfetto (ui.perfetto.dev) and chrome://tracing.

Each run becomes a process. Its first track shows the engine's steps; then
one track per request (in order of first appearance) shows a slice for every
step that computed tokens for it, named by phase (``prefill``, ``decode``,
``recompute``; ``(partial)`` when the chunk does not reach the request's
last token), with the token range in its args. Preemptions and finishes are
instant events on the request's track. Counter tracks show the tokens of
each step by phase, the KV blocks used and free, and the requests running
and waiting.

The format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
(times in microseconds; ``X`` complete slices, ``i`` instants, ``C`` counters,
``M`` metadata naming processes and threads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvserve.trace.reader import TraceRun
from kvserve.trace.records import PHASES, StepRecord

Event = dict[str, Any]

STEPS_TID = 0  # the engine-steps track; requests get 1, 2, ...


def to_chrome(runs: Sequence[TraceRun]) -> dict[str, Any]:
    """The Chrome trace-event JSON object (``{"traceEvents": [...], ...}``) of ``runs``."""
    events: list[Event] = []
    for run in runs:
        events += _run_events(run)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "kvserve step trace", "runs": len(runs)},
    }


def _micros(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _metadata(kind: str, pid: int, tid: int, args: dict[str, Any]) -> Event:
    """A metadata event: ``kind`` is process_name, thread_name or a sort index."""
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def _run_events(run: TraceRun) -> list[Event]:
    header = run.header
    pid = header["run"] + 1
    events = [
        _metadata(
            "process_name", pid, STEPS_TID, {"name": f"run {header['run']}: {header['model']}"}
        ),
        _metadata("process_sort_index", pid, STEPS_TID, {"sort_index": pid}),
        _metadata("thread_name", pid, STEPS_TID, {"name": "engine steps"}),
        _metadata("thread_sort_index", pid, STEPS_TID, {"sort_index": STEPS_TID}),
    ]
    tids: dict[str, int] = {}

    def track(request_id: str) -> int:
        tid = tids.get(request_id)
        if tid is None:
            tid = tids[request_id] = len(tids) + 1
            events.append(_metadata("thread_name", pid, tid, {"name": f"request {request_id}"}))
            events.append(_metadata("thread_sort_index", pid, tid, {"sort_index": tid}))
        return tid

    for step in run.steps:
        events += _step_events(step, pid, track)
    return events


def _step_events(step: StepRecord, pid: int, track: Callable[[str], int]) -> list[Event]:
    start, end = _micros(step["start_s"]), _micros(step["end_s"])
    duration = end - start
    tokens_by_phase: dict[str, int] = dict.fromkeys(PHASES, 0)
    events: list[Event] = []
    for request_id in step["preempted"]:
        # Preemption happens while the step is scheduled, before its forward pass.
        events.append(
            {
                "ph": "i",
                "s": "t",
                "name": "preempted",
                "pid": pid,
                "tid": track(request_id),
                "ts": start,
                "args": {"step": step["step"]},
            }
        )
    for entry in step["scheduled"]:
        tokens_by_phase[entry["phase"]] += entry["tokens"]
        name = entry["phase"] + (" (partial)" if entry["partial"] else "")
        args = {
            "step": step["step"],
            "tokens": entry["tokens"],
            "positions": f"{entry['start']}-{entry['start'] + entry['tokens']}",
            "prompt_len": entry["prompt_len"],
            "partial": entry["partial"],
        }
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": entry["phase"],
                "pid": pid,
                "tid": track(entry["id"]),
                "ts": start,
                "dur": duration,
                "args": args,
            }
        )
    for finished in step["finished"]:
        events.append(
            {
                "ph": "i",
                "s": "t",
                "name": f"finished ({finished['reason']})",
                "pid": pid,
                "tid": track(finished["id"]),
                "ts": end,
                "args": dict(finished),
            }
        )
    step_args = {
        "tokens": step["num_tokens"],
        **{f"{phase}_tokens": count for phase, count in tokens_by_phase.items()},
        "requests": len(step["scheduled"]),
        "preempted": len(step["preempted"]),
        "blocks_used": step["blocks_used"],
    }
    events.append(
        {
            "ph": "X",
            "name": f"step {step['step']}",
            "cat": "step",
            "pid": pid,
            "tid": STEPS_TID,
            "ts": start,
            "dur": duration,
            "args": step_args,
        }
    )
    # Tokens drop to zero between steps, so idle time shows as idle.
    events.append(_counter("tokens per step", pid, start, tokens_by_phase))
    events.append(_counter("tokens per step", pid, end, dict.fromkeys(PHASES, 0)))
    blocks = {"used": step["blocks_used"], "free": step["blocks_free"]}
    events.append(_counter("KV blocks", pid, start, blocks))
    events.append(
        _counter("KV blocks in prefix cache", pid, end, {"cached": step["blocks_cached"]})
    )
    queues = {"running": step["num_running"], "waiting": step["num_waiting"]}
    events.append(_counter("requests", pid, end, queues))
    if step.get("spec_proposed"):
        # Like tokens per step, over the step and back to zero after it; only steps that
        # verified proposals add samples, so a run without speculation gets no empty track.
        spec = {"proposed": step["spec_proposed"], "accepted": step.get("spec_accepted", 0)}
        events.append(_counter("speculative tokens", pid, start, spec))
        events.append(_counter("speculative tokens", pid, end, dict.fromkeys(spec, 0)))
    if step.get("disk_loads") or step.get("disk_writes"):
        disk = {"loaded": step.get("disk_loads", 0), "written": step.get("disk_writes", 0)}
        events.append(_counter("KV blocks to and from disk", pid, start, disk))
        events.append(_counter("KV blocks to and from disk", pid, end, dict.fromkeys(disk, 0)))
    return events


def _counter(name: str, pid: int, ts: float, values: dict[str, int]) -> Event:
    return {"ph": "C", "name": name, "pid": pid, "tid": STEPS_TID, "ts": ts, "args": values}
