"""Percentiles of a list of samples, shared by the dashboard and the benchmarks.

It lives in ``core/`` (plain Python, no dependencies) so that a surface such as
the dashboard and the top-floor benchmarks compute latency percentiles one way
without the dashboard importing the benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
