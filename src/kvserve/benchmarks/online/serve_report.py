"""``kvserve bench serve``'s results: the medians and failures, printed and as JSON."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.benchmarks.common import Table
from kvserve.benchmarks.online.serve_args import json_args
from kvserve.benchmarks.online.serve_metrics import ServeMetrics


@dataclass(frozen=True)
class ServeReport:
    """Every repetition's figures, their medians, and the failures over all of them."""

    model: str
    median: ServeMetrics
    runs: list[ServeMetrics]
    num_failed: int
    first_error: str | None


def json_payload(args: argparse.Namespace, report: ServeReport) -> dict[str, Any]:
    """The arguments (the API key withheld) and every figure."""
    return {
        "args": json_args(args),
        "model": report.model,
        "expected_output_tokens": args.num_requests * args.max_tokens,
        "median": asdict(report.median),
        "runs": [asdict(run) for run in report.runs],
        "num_failed": report.num_failed,
        "first_error": report.first_error,
    }


def print_report(args: argparse.Namespace, report: ServeReport) -> None:
    """The load in one line, the latency table, then throughput, token counts and failures."""
    median = report.median
    print(
        f"{args.num_requests} requests, {args.concurrency} at a time, to {args.base_url} "
        f"({args.endpoint}, model {report.model}): {prompt_description(args)}, "
        f"{args.max_tokens} output tokens each; "
        f"median of {args.repetitions}"
    )
    table = Table(["ms", "p50", "p90", "p99", "max"])
    table.add("TTFT", median.ttft_p50_ms, median.ttft_p90_ms, median.ttft_p99_ms, "-")
    table.add("ITL", median.itl_p50_ms, median.itl_p90_ms, median.itl_p99_ms, "-")
    table.add("chunk gap", median.gap_p50_ms, "-", median.gap_p99_ms, median.gap_max_ms)
    print(table.render())
    by_usage, succeeded = median.num_counted_by_usage, median.num_succeeded
    if by_usage == succeeded:
        counted = "counted from the server's usage"
    elif by_usage == 0:
        counted = "counted one per chunk of text: the server sent no usage"
    else:
        counted = f"{by_usage} of {succeeded} requests counted from usage, the rest one per chunk"
    print(
        f"wall {median.wall_s:.2f} s, {median.output_tokens:,} output tokens ({counted}), "
        f"{median.output_tokens_per_s:,.1f} tok/s, {median.requests_per_s:.2f} req/s"
    )
    expected = succeeded * args.max_tokens
    if median.output_tokens != expected:
        why = (
            "the server stopped some requests early: does it honour ignore_eos?"
            if by_usage == succeeded
            else "without usage a chunk counts as one token, however many it carries"
        )
        print(f"note: {expected:,} output tokens expected ({args.max_tokens} a request); {why}")
    if report.num_failed:
        total = args.num_requests * args.repetitions
        print(f"{report.num_failed} of {total} requests failed; first error: {report.first_error}")


def prompt_description(args: argparse.Namespace) -> str:
    """The prompts in words, for the report's first line."""
    if args.prompt_kind != "shared-prefix":
        return f"~{args.prompt_tokens}-token prompts"
    prefix = f"~{args.shared_prefix_tokens}-token shared prefix"
    if args.num_prefixes > 1:
        prefix = f"one of {args.num_prefixes} {prefix}es"
    return f"{prefix} + ~{args.prompt_tokens}-token questions"
