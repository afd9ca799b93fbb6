"""The figures of ``kvserve bench serve``: one run's requests in, latencies and rates out."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any

from kvserve.benchmarks.common import percentile
from kvserve.benchmarks.online.serve_client import RunRecord


@dataclass(frozen=True)
class ServeMetrics:
    """One run's figures. Latencies are in milliseconds, over the requests that succeeded.

    ITL percentiles are over requests (each request's mean time per token after
    its first); gap percentiles are over every pause between consecutive
    chunks of text of every request.
    """

    wall_s: float
    num_succeeded: int
    num_failed: int
    output_tokens: int
    # Requests whose tokens were counted from the server's usage (the rest: one per chunk).
    num_counted_by_usage: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    gap_p50_ms: float
    gap_p99_ms: float
    gap_max_ms: float


def summarize(run: RunRecord) -> ServeMetrics:
    """The figures of one run."""
    succeeded = [record for record in run.requests if record.error is None]
    output_tokens = sum(record.num_tokens for record in succeeded)
    ttfts = [record.ttft for record in succeeded if record.ttft is not None]
    itls = [record.itl for record in succeeded if record.itl is not None]
    gaps = [gap for record in succeeded for gap in record.gaps]

    def ms(values: list[float], q: float) -> float:
        return 1000 * percentile(values, q)

    wall_s = run.wall_s
    return ServeMetrics(
        wall_s=wall_s,
        num_succeeded=len(succeeded),
        num_failed=len(run.requests) - len(succeeded),
        output_tokens=output_tokens,
        num_counted_by_usage=sum(record.usage_tokens is not None for record in succeeded),
        output_tokens_per_s=output_tokens / wall_s if wall_s > 0 else 0.0,
        requests_per_s=len(succeeded) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_ms=ms(ttfts, 50),
        ttft_p90_ms=ms(ttfts, 90),
        ttft_p99_ms=ms(ttfts, 99),
        itl_p50_ms=ms(itls, 50),
        itl_p90_ms=ms(itls, 90),
        itl_p99_ms=ms(itls, 99),
        gap_p50_ms=ms(gaps, 50),
        gap_p99_ms=ms(gaps, 99),
        gap_max_ms=ms(gaps, 100),
    )


def median_of(runs: list[ServeMetrics]) -> ServeMetrics:
    """Each figure's median over the runs; counts take a value some run really had."""
    values: dict[str, Any] = {}
    for field in fields(ServeMetrics):
        column = [getattr(run, field.name) for run in runs]
        is_count = isinstance(column[0], int)
        values[field.name] = (
            statistics.median_low(column) if is_count else statistics.median(column)
        )
    return ServeMetrics(**values)
