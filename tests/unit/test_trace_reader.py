"""Reading a trace file checks every record and names the line and field at fault."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.cli import main
from kvserve.errors import InvalidParameterError
from kvserve.trace import read_trace, to_chrome

HEADER: dict[str, Any] = {
    "kind": "run",
    "format": 1,
    "run": 0,
    "model": "tiny",
    "block_size": 4,
    "num_blocks": 8,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "enable_chunked_prefill": True,
    "max_prefill_tokens_while_decoding": None,
    "policy": "fcfs",
    "enable_prefix_caching": False,
    "started_at": "2025-01-01T00:00:00+0000",
}
STEP: dict[str, Any] = {
    "kind": "step",
    "run": 0,
    "step": 0,
    "start_s": 0.5,
    "end_s": 0.75,
    "num_tokens": 13,
    "scheduled": [
        {
            "id": "a",
            "phase": "prefill",
            "start": 0,
            "tokens": 12,
            "partial": True,
            "prompt_len": 20,
        },
        {"id": "b", "phase": "decode", "start": 9, "tokens": 1, "partial": False, "prompt_len": 9},
    ],
    "preempted": ["c"],
    "finished": [{"id": "b", "reason": "length", "prompt_len": 9, "output_len": 1}],
    "blocks_used": 6,
    "blocks_free": 2,
    "blocks_cached": 0,
    "num_running": 1,
    "num_waiting": 1,
}


def write(path: Path, *records: Any) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def with_change(record: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of ``record`` with ``dotted`` (``"scheduled.0.phase"``) set or, for ..., removed."""
    changed = copy.deepcopy(record)
    *parents, last = dotted.split(".")
    target: Any = changed
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is ...:
        del target[last]
    else:
        target[int(last) if isinstance(target, list) else last] = value
    return changed


def test_a_valid_trace_reads_back_and_converts(tmp_path: Path) -> None:
    runs = read_trace(write(tmp_path / "t.jsonl", HEADER, STEP))
    assert len(runs) == 1 and runs[0].steps == [STEP]
    events = to_chrome(runs)["traceEvents"]
    slices = [e for e in events if e["ph"] == "X" and e["cat"] != "step"]
    assert [(e["name"], e["ts"], e["dur"]) for e in slices] == [
        ("prefill (partial)", 500000.0, 250000.0),
        ("decode", 500000.0, 250000.0),
    ]
    assert slices[0]["args"]["positions"] == "0-12"
    instants = [(e["name"], e["ts"]) for e in events if e["ph"] == "i"]
    assert instants == [("preempted", 500000.0), ("finished (length)", 750000.0)]


def test_a_step_s_speculation_reads_back_and_becomes_a_counter(tmp_path: Path) -> None:
    step = STEP | {"spec_proposed": 6, "spec_accepted": 4}
    quiet = with_change(STEP, "step", 1) | {"spec_proposed": 0, "spec_accepted": 0}
    runs = read_trace(write(tmp_path / "t.jsonl", HEADER, step, quiet))
    assert runs[0].steps == [step, quiet]
    counters = [
        (e["ts"], e["args"])
        for e in to_chrome(runs)["traceEvents"]
        if e["ph"] == "C" and e["name"] == "speculative tokens"
    ]
    # Over the step that verified proposals, back to zero at its end; nothing for the other.
    assert counters == [
        (500000.0, {"proposed": 6, "accepted": 4}),
        (750000.0, {"proposed": 0, "accepted": 0}),
    ]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "is empty"),
        (["{not json"], "line 1 is not JSON"),
        ([json.dumps(STEP)], "line 1: step of run 0, which no run record opened"),
        ([json.dumps([1, 2])], "line 1: expected a JSON object"),
        ([json.dumps({"kind": "span"})], "line 1: 'kind' must be 'run' or 'step'"),
        ([json.dumps(with_change(HEADER, "format", 99))], "trace format 99 is not supported"),
        ([json.dumps(with_change(HEADER, "block_size", ...))], "missing field 'block_size'"),
        ([json.dumps(HEADER), json.dumps(with_change(STEP, "step", 3))], "line 2: step 3"),
        (
            [json.dumps(HEADER), json.dumps(with_change(STEP, "blocks_used", "six"))],
            "line 2: 'blocks_used' must be an integer, got str",
        ),
        (
            [json.dumps(HEADER), json.dumps(with_change(STEP, "num_tokens", True))],
            "'num_tokens' must not be a boolean",
        ),
        (
            [json.dumps(HEADER), json.dumps(with_change(STEP, "scheduled.0.phase", "warmup"))],
            "has phase 'warmup'",
        ),
        (
            [json.dumps(HEADER), json.dumps(with_change(STEP, "num_tokens", 12))],
            "num_tokens is not the sum",
        ),
        (
            [json.dumps(HEADER), json.dumps(with_change(STEP, "end_s", 0.1))],
            "end_s is before start_s",
        ),
        (
            [json.dumps(HEADER), json.dumps(with_change(STEP, "finished.0.output_len", ...))],
            "finished entry: missing field 'output_len'",
        ),
        (
            [json.dumps(HEADER), json.dumps(STEP | {"spec_proposed": 3, "spec_accepted": 4})],
            "spec_accepted (4) must be from 0 to spec_proposed (3)",
        ),
        (
            [json.dumps(HEADER), json.dumps(STEP | {"spec_proposed": "3"})],
            "'spec_proposed' must be an integer, got str",
        ),
    ],
)
def test_a_bad_trace_is_refused_with_the_line_and_field(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(InvalidParameterError) as error:
        read_trace(path)
    assert error.value.param == "trace"
    assert message in str(error.value)


def test_the_trace_command_reports_bad_input_as_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "error: trace: cannot read" in capsys.readouterr().err
    path = write(tmp_path / "t.jsonl", HEADER, STEP)
    assert main(["trace", str(path), "--chrome", str(tmp_path / "no" / "dir.json")]) == 2
    assert "error: chrome: cannot write" in capsys.readouterr().err


def test_the_trace_command_summarizes_and_writes_chrome_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "t.jsonl", HEADER, STEP)
    out = tmp_path / "chrome.json"
    assert main(["trace", str(path), "--chrome", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 steps" in printed and "1 preemptions" in printed
    assert "tokens: prefill 12, decode 1, recompute 0 (1 partial chunks)" in printed
    chrome = json.loads(out.read_text(encoding="utf-8"))
    assert chrome["displayTimeUnit"] == "ms"
    names = {e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"engine steps", "request a", "request b", "request c"}
