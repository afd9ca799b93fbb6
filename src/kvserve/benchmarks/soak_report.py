"""The findings of ``kvserve bench soak``: outcomes by kind, the server's state after, its memory.

The verdict is the run's purpose: under mixed and hostile load for a long
time, the server answers every valid request without a 5xx and every other
one as expected, gives back every KV block once the load stops, and its
resident memory after warm-up stays within a bound.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvserve.benchmarks.common import Table
from kvserve.benchmarks.soak_requests import KINDS_BY_NAME

MIB = 1024 * 1024
MAX_KEPT_FAILURES = 20


@dataclass(frozen=True)
class RssSample:
    """The server's resident memory ``seconds`` after the load started."""

    seconds: float
    rss_bytes: int


@dataclass(frozen=True)
class RssSummary:
    """Resident memory after warm-up against later: the end, the peak, their growth."""

    warm_bytes: int  # the first sample at or after the warm-up
    end_bytes: int  # the last sample (after the load stopped and the server drained)
    max_bytes: int  # the largest after warm-up
    num_samples: int

    @property
    def growth_bytes(self) -> int:
        """End minus warm (negative when memory was given back)."""
        return self.end_bytes - self.warm_bytes

    @property
    def max_growth_bytes(self) -> int:
        """Peak minus warm: the largest drift seen after warm-up."""
        return self.max_bytes - self.warm_bytes


def summarize_rss(samples: list[RssSample], warmup_s: float) -> RssSummary | None:
    """The summary of the samples taken after ``warmup_s``; None without any."""
    warm = [sample for sample in samples if sample.seconds >= warmup_s]
    if not warm:
        return None
    return RssSummary(
        warm_bytes=warm[0].rss_bytes,
        end_bytes=warm[-1].rss_bytes,
        max_bytes=max(sample.rss_bytes for sample in warm),
        num_samples=len(warm),
    )


@dataclass
class SoakReport:
    """Everything a soak run found."""

    duration_s: float
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, outcome)
    failures: list[str] = field(default_factory=list)  # the first few, with details
    blocks_used_end: float | None = None  # from /metrics after the drain
    sequences_held_end: float | None = None  # running + waiting, after the drain
    preemptions: float | None = None  # during the run
    rss: RssSummary | None = None
    max_rss_growth_bytes: int = 256 * MIB
    wall_s: float = 0.0

    def record(self, kind: str, outcome: str, detail: str | None) -> None:
        self.outcomes[(kind, outcome)] += 1
        if not is_expected(kind, outcome) and len(self.failures) < MAX_KEPT_FAILURES:
            self.failures.append(f"{kind}: {outcome}" + (f": {detail}" if detail else ""))

    @property
    def num_requests(self) -> int:
        return sum(self.outcomes.values())

    @property
    def valid_5xx(self) -> int:
        """5xx answers (a failure reported inside a stream included) to valid requests."""
        return sum(
            count
            for (kind, outcome), count in self.outcomes.items()
            if KINDS_BY_NAME[kind].valid and is_server_error(outcome)
        )

    @property
    def num_unexpected(self) -> int:
        return sum(
            count
            for (kind, outcome), count in self.outcomes.items()
            if not is_expected(kind, outcome)
        )

    def problems(self) -> list[str]:
        """Why the run failed; empty when it passed."""
        problems = []
        if self.valid_5xx:
            problems.append(f"{self.valid_5xx} valid requests got a 5xx")
        if self.num_unexpected:
            problems.append(
                f"{self.num_unexpected} requests got an answer their kind did not expect"
            )
        if self.blocks_used_end is None:
            problems.append("the KV blocks in use could not be read from /metrics")
        elif self.blocks_used_end != 0:
            problems.append(f"{self.blocks_used_end:g} KV blocks still in use after the load")
        if self.sequences_held_end:
            problems.append(f"{self.sequences_held_end:g} sequences still held after the load")
        if self.rss is not None and self.rss.max_growth_bytes > self.max_rss_growth_bytes:
            problems.append(
                f"resident memory grew {self.rss.max_growth_bytes / MIB:.0f} MiB after warm-up "
                f"(allowed {self.max_rss_growth_bytes / MIB:.0f} MiB)"
            )
        return problems

    @property
    def passed(self) -> bool:
        return not self.problems()

    def format(self) -> str:
        table = Table(["kind", "requests", "outcomes", "unexpected"])
        for kind in KINDS_BY_NAME:
            counts = {o: n for (k, o), n in sorted(self.outcomes.items()) if k == kind}
            unexpected = sum(n for o, n in counts.items() if not is_expected(kind, o))
            outcomes = ", ".join(f"{o}: {n}" for o, n in counts.items()) or "-"
            table.add(kind, sum(counts.values()), outcomes, unexpected)
        lines = [
            f"soak: {self.num_requests:,} requests in {self.wall_s:.0f} s",
            table.render(),
            f"5xx on valid requests: {self.valid_5xx}",
            f"KV blocks in use after the load: {_or_unknown(self.blocks_used_end)}; "
            f"sequences held: {_or_unknown(self.sequences_held_end)}; "
            f"preemptions during the run: {_or_unknown(self.preemptions)}",
            self._rss_line(),
        ]
        lines += [f"- {failure}" for failure in self.failures]
        problems = self.problems()
        lines.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
        return "\n".join(lines)

    def _rss_line(self) -> str:
        if self.rss is None:
            return "server memory: not measured (pass --server-pid)"
        rss = self.rss
        return (
            f"server RSS: {rss.warm_bytes / MIB:.0f} MiB after warm-up, "
            f"{rss.end_bytes / MIB:.0f} MiB at the end ({rss.growth_bytes / MIB:+.0f} MiB), "
            f"peak {rss.max_bytes / MIB:.0f} MiB (max drift {rss.max_growth_bytes / MIB:+.0f} MiB, "
            f"{rss.num_samples} samples)"
        )

    def as_json(self) -> dict[str, Any]:
        rss = None
        if self.rss is not None:
            rss = {
                "warm_bytes": self.rss.warm_bytes,
                "end_bytes": self.rss.end_bytes,
                "max_bytes": self.rss.max_bytes,
                "growth_bytes": self.rss.growth_bytes,
                "max_growth_bytes": self.rss.max_growth_bytes,
                "num_samples": self.rss.num_samples,
            }
        return {
            "duration_s": self.duration_s,
            "wall_s": round(self.wall_s, 1),
            "requests": self.num_requests,
            "outcomes": [
                {"kind": kind, "outcome": outcome, "count": count}
                for (kind, outcome), count in sorted(self.outcomes.items())
            ],
            "valid_5xx": self.valid_5xx,
            "unexpected": self.num_unexpected,
            "failures": self.failures,
            "kv_blocks_used_end": self.blocks_used_end,
            "sequences_held_end": self.sequences_held_end,
            "preemptions": self.preemptions,
            "rss": rss,
            "max_rss_growth_bytes": self.max_rss_growth_bytes,
            "problems": self.problems(),
            "passed": self.passed,
        }


def is_expected(kind: str, outcome: str) -> bool:
    return outcome in KINDS_BY_NAME[kind].expected


def is_server_error(outcome: str) -> bool:
    return outcome == "error event" or (outcome.isdigit() and int(outcome) >= 500)


def _or_unknown(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}"
