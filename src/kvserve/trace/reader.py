"""Reading a step trace back: runs of step records, checked field by field.

A trace file comes from outside (a user may point ``kvserve trace`` at any
file), so every record is checked before anything is built from it; a bad
one raises :class:`InvalidParameterError` naming the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvserve.errors import InvalidParameterError
from kvserve.trace.records import PHASES, TRACE_FORMAT_VERSION, RunHeader, StepRecord

__all__ = ["TraceRun", "read_trace", "runs_from_records"]

_NUMBER = (int, float)
_OPTIONAL_INT = (int, type(None))
_OPTIONAL_STR = (str, type(None))
_HEADER_FIELDS: dict[str, Any] = {
    "format": int,
    "run": int,
    "model": str,
    "block_size": int,
    "num_blocks": int,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "enable_chunked_prefill": bool,
    "max_prefill_tokens_while_decoding": _OPTIONAL_INT,
    "policy": str,
    "enable_prefix_caching": bool,
}
_STEP_FIELDS: dict[str, Any] = {
    "run": int,
    "step": int,
    "start_s": _NUMBER,
    "end_s": _NUMBER,
    "num_tokens": int,
    "scheduled": list,
    "preempted": list,
    "finished": list,
    "blocks_used": int,
    "blocks_free": int,
    "blocks_cached": int,
    "num_running": int,
    "num_waiting": int,
}
# Fields a step record may lack (a trace written before they existed): absent means 0.
_OPTIONAL_STEP_FIELDS = ("spec_proposed", "spec_accepted", "disk_loads", "disk_writes")
_SCHEDULED_FIELDS: dict[str, Any] = {
    "id": str,
    "phase": str,
    "start": int,
    "tokens": int,
    "partial": bool,
    "prompt_len": int,
}
_FINISHED_FIELDS: dict[str, Any] = {
    "id": str,
    "reason": _OPTIONAL_STR,
    "prompt_len": int,
    "output_len": int,
}


@dataclass
class TraceRun:
    """One engine's part of a trace: its settings and its steps, in order."""

    header: RunHeader
    steps: list[StepRecord] = field(default_factory=list)


def read_trace(path: str | Path) -> list[TraceRun]:
    """The runs of the trace file at ``path`` (see ``records.py`` for the format)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError("trace", f"cannot read {str(path)!r}: {exc}") from exc
    records = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((line_no, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(
                "trace", f"{path}: line {line_no} is not JSON ({exc.msg})"
            ) from exc
    if not records:
        raise InvalidParameterError("trace", f"{path} is empty; a trace starts with a run record")
    return _runs(records, str(path))


def runs_from_records(records: Iterable[Mapping[str, Any]]) -> list[TraceRun]:
    """The runs of records kept in memory (``TraceMemory.records``), checked like a file's."""
    return _runs([(index + 1, record) for index, record in enumerate(records)], "trace")


def _runs(records: list[tuple[int, Any]], source: str) -> list[TraceRun]:
    runs: list[TraceRun] = []
    for line_no, record in records:
        where = f"{source}: line {line_no}"
        if not isinstance(record, dict):
            raise InvalidParameterError("trace", f"{where}: expected a JSON object")
        kind = record.get("kind")
        if kind == "run":
            _check_fields(record, _HEADER_FIELDS, where)
            if record["format"] != TRACE_FORMAT_VERSION:
                raise InvalidParameterError(
                    "trace",
                    f"{where}: trace format {record['format']} is not supported "
                    f"(this kvserve reads format {TRACE_FORMAT_VERSION})",
                )
            if record["run"] != len(runs):
                raise InvalidParameterError(
                    "trace", f"{where}: run {record['run']} out of order (expected {len(runs)})"
                )
            runs.append(TraceRun(cast(RunHeader, record)))
        elif kind == "step":
            _check_step(record, where)
            if not 0 <= record["run"] < len(runs):
                raise InvalidParameterError(
                    "trace", f"{where}: step of run {record['run']}, which no run record opened"
                )
            run = runs[record["run"]]
            if record["step"] != len(run.steps):
                raise InvalidParameterError(
                    "trace",
                    f"{where}: step {record['step']} of run {record['run']} out of order "
                    f"(expected {len(run.steps)})",
                )
            run.steps.append(cast(StepRecord, record))
        else:
            raise InvalidParameterError(
                "trace", f"{where}: 'kind' must be 'run' or 'step', got {kind!r}"
            )
    return runs


def _check_step(record: dict[str, Any], where: str) -> None:
    _check_fields(record, _STEP_FIELDS, where)
    if record["end_s"] < record["start_s"]:
        raise InvalidParameterError("trace", f"{where}: end_s is before start_s")
    present = {name: int for name in _OPTIONAL_STEP_FIELDS if name in record}
    _check_fields(record, present, where)
    proposed, accepted = record.get("spec_proposed", 0), record.get("spec_accepted", 0)
    if not 0 <= accepted <= proposed:
        raise InvalidParameterError(
            "trace",
            f"{where}: spec_accepted ({accepted}) must be from 0 to spec_proposed ({proposed})",
        )
    for name in ("disk_loads", "disk_writes"):
        if record.get(name, 0) < 0:
            raise InvalidParameterError("trace", f"{where}: {name} must not be negative")
    for entry in record["scheduled"]:
        _check_fields(entry, _SCHEDULED_FIELDS, f"{where}: scheduled entry")
        if entry["phase"] not in PHASES:
            raise InvalidParameterError(
                "trace",
                f"{where}: scheduled entry {entry['id']!r} has phase {entry['phase']!r}; "
                f"expected one of {', '.join(PHASES)}",
            )
        if entry["tokens"] < 1 or entry["start"] < 0:
            raise InvalidParameterError(
                "trace", f"{where}: scheduled entry {entry['id']!r} has an empty or negative range"
            )
    if sum(entry["tokens"] for entry in record["scheduled"]) != record["num_tokens"]:
        raise InvalidParameterError(
            "trace", f"{where}: num_tokens is not the sum of the scheduled tokens"
        )
    for request_id in record["preempted"]:
        if not isinstance(request_id, str):
            raise InvalidParameterError("trace", f"{where}: preempted must hold request ids")
    for entry in record["finished"]:
        _check_fields(entry, _FINISHED_FIELDS, f"{where}: finished entry")


def _check_fields(record: Any, fields: Mapping[str, Any], where: str) -> None:
    if not isinstance(record, dict):
        raise InvalidParameterError("trace", f"{where}: expected a JSON object")
    for name, kinds in fields.items():
        if name not in record:
            raise InvalidParameterError("trace", f"{where}: missing field {name!r}")
        value = record[name]
        # isinstance(True, int) holds in Python: a boolean is no number here.
        if isinstance(value, bool) and bool not in _as_tuple(kinds):
            raise InvalidParameterError("trace", f"{where}: {name!r} must not be a boolean")
        if not isinstance(value, kinds):
            raise InvalidParameterError(
                "trace",
                f"{where}: {name!r} must be {_describe(kinds)}, got {type(value).__name__}",
            )


def _as_tuple(kinds: Any) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _describe(kinds: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
    names.update({list: "a list", type(None): "null"})
    return " or ".join(names.get(kind, kind.__name__) for kind in _as_tuple(kinds))
