"""``kvserve trace FILE``: summarize a step trace, or convert it with ``--chrome OUT.json``;
and the ``--trace FILE`` flag of the commands that run an engine."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidParameterError
from kvserve.trace.chrome import to_chrome
from kvserve.trace.reader import TraceRun, read_trace
from kvserve.trace.records import PHASES
from kvserve.trace.tracer import TraceFile


def add_trace_arg(parser: argparse.ArgumentParser) -> None:
    """``--trace FILE``: record one JSON line per engine step."""
    parser.add_argument(
        "--trace",
        metavar="FILE",
        type=Path,
        help="write one JSON line per engine step to FILE "
        "(view it with `kvserve trace FILE --chrome OUT.json` and Perfetto)",
    )


@contextmanager
def open_trace(path: Path | None) -> Iterator[TraceFile | None]:
    """The trace file ``--trace`` asks for (None without it), closed on leaving."""
    if path is None:
        yield None
        return
    trace = TraceFile(path)
    try:
        yield trace
    finally:
        trace.close()


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="summarize a step trace (--trace FILE), or convert it for Perfetto",
        description=(
            "Summarize a step trace written with --trace FILE; with --chrome, convert it to "
            "the Chrome trace-event format that https://ui.perfetto.dev and chrome://tracing open."
        ),
    )
    parser.add_argument("file", type=Path, metavar="FILE", help="a trace written with --trace")
    parser.add_argument("--chrome", type=Path, metavar="OUT.json", help="write Chrome trace events")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    runs = read_trace(args.file)
    for trace_run in runs:
        print(summarize(trace_run))
    if args.chrome is not None:
        chrome = to_chrome(runs)
        try:
            args.chrome.write_text(json.dumps(chrome) + "\n", encoding="utf-8")
        except OSError as exc:
            raise InvalidParameterError(
                "chrome", f"cannot write {str(args.chrome)!r}: {exc}"
            ) from exc
        print(
            f"wrote {args.chrome} ({len(chrome['traceEvents'])} events): open it in "
            "https://ui.perfetto.dev or chrome://tracing"
        )
    return 0


def summarize(trace_run: TraceRun) -> str:
    """A few lines on one run: its settings, steps, tokens by phase, preemptions, blocks."""
    header, steps = trace_run.header, trace_run.steps
    tokens = dict.fromkeys(PHASES, 0)
    partial_chunks = 0
    # A benchmark may reuse an id once its request finished: count requests, not ids.
    active: set[str] = set()
    num_requests = 0
    for step in steps:
        for entry in step["scheduled"]:
            tokens[entry["phase"]] += entry["tokens"]
            partial_chunks += entry["partial"]
            if entry["id"] not in active:
                active.add(entry["id"])
                num_requests += 1
        active.difference_update(finished["id"] for finished in step["finished"])
    num_finished = sum(len(step["finished"]) for step in steps)
    num_preempted = sum(len(step["preempted"]) for step in steps)
    peak_blocks = max((step["blocks_used"] for step in steps), default=0)
    wall_s = steps[-1]["end_s"] - steps[0]["start_s"] if steps else 0.0
    chunked = "on" if header["enable_chunked_prefill"] else "off"
    token_parts = ", ".join(f"{phase} {count}" for phase, count in tokens.items())
    return "\n".join(
        [
            f"run {header['run']}: {header['model']}; {header['num_blocks']} blocks of "
            f"{header['block_size']} tokens, budget {header['max_num_batched_tokens']} tokens, "
            f"chunked prefill {chunked}",
            f"  {len(steps)} steps in {wall_s:.3f} s; {num_requests} requests, "
            f"{num_finished} finished; {num_preempted} preemptions",
            f"  tokens: {token_parts} ({partial_chunks} partial chunks)",
            f"  peak KV blocks used: {peak_blocks} of {header['num_blocks']}",
        ]
    )
