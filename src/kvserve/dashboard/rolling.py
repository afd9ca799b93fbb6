"""Rolling figures of the dashboard: token rates over the last seconds, latency percentiles.

Shared by the live sampler and the trace replay, so both compute them one way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvserve.core.percentile import percentile
from kvserve.dashboard.state import Percentiles

# Latency samples kept for the percentiles: recent requests' TTFTs, recent tokens' gaps.
NUM_LATENCY_SAMPLES = 512
# Seconds of steps the token rates average over.
RATE_WINDOW_S = 5.0


class RateWindow:
    """Two token counts per second over the last ``window_s`` seconds of steps (generated
    and computed tokens; speculative proposals and acceptances)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, int, int]] = deque()  # (end time, first, second)
        self._first = 0
        self._second = 0

    def add(self, now: float, first: int, second: int) -> None:
        self._steps.append((now, first, second))
        self._first += first
        self._second += second
        self._expire(now)

    def rates(self, now: float) -> tuple[float, float]:
        """(first, second) per second; the oldest step only opens the window."""
        self._expire(now)
        if len(self._steps) < 2:
            return 0.0, 0.0
        start, oldest_first, oldest_second = self._steps[0]
        span = now - start
        if span <= 0:
            return 0.0, 0.0
        return (self._first - oldest_first) / span, (self._second - oldest_second) / span

    def _expire(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            _, first, second = self._steps.popleft()
            self._first -= first
            self._second -= second


def latency_percentiles(samples: Sequence[float]) -> Percentiles | None:
    """p50, p90 and p99 of ``samples`` (seconds), or None for none."""
    if not samples:
        return None
    return Percentiles(
        p50=round(percentile(samples, 50), 5),
        p90=round(percentile(samples, 90), 5),
        p99=round(percentile(samples, 99), 5),
        count=len(samples),
    )
