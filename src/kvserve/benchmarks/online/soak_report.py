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
from kvserve.benchmarks.online.soak_hostile import HOSTILE_KINDS
from kvserve.benchmarks.online.soak_requests import KINDS
from kvserve.benchmarks.online.soak_template import TEMPLATE_KIND, TemplateServerReport

ALL_KINDS = (*KINDS, *HOSTILE_KINDS, TEMPLATE_KIND)
KINDS_BY_NAME = {kind.name: kind for kind in ALL_KINDS}

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
class HealthProbes:
    """The server's /health, asked throughout the run: how often, how slowly, how often it failed."""

    limit_s: float = 1.0
    num_probes: int = 0
    num_slow: int = 0  # answered after more than limit_s
    num_failed: int = 0  # no answer, or not a 200
    max_s: float = 0.0

    def record(self, seconds: float, healthy: bool) -> None:
        self.num_probes += 1
        self.max_s = max(self.max_s, seconds)
        if not healthy:
            self.num_failed += 1
        elif seconds > self.limit_s:
            self.num_slow += 1

    def line(self) -> str:
        if not self.num_probes:
            return "/health: not asked"
        return (
            f"/health: {self.num_probes} probes, slowest {self.max_s:.3f} s (limit "
            f"{self.limit_s:g} s), {self.num_slow} slow, {self.num_failed} failed"
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
    output_tokens: int = 0  # generated for valid requests answered in full
    health: HealthProbes = field(default_factory=HealthProbes)
    kinds: tuple[str, ...] = tuple(kind.name for kind in KINDS)  # the kinds this run sends
    template_server: TemplateServerReport | None = None  # with --template-model

    def record(self, kind: str, outcome: str, detail: str | None, output_tokens: int = 0) -> None:
        self.outcomes[(kind, outcome)] += 1
        if KINDS_BY_NAME[kind].valid and outcome == "200":
            self.output_tokens += output_tokens
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

    @property
    def output_tokens_per_s(self) -> float:
        """Tokens generated for valid requests over the load's wall time (in-flight ones included)."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

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
        if self.health.num_slow or self.health.num_failed:
            problems.append(
                f"/health was slower than {self.health.limit_s:g} s {self.health.num_slow} times "
                f"and failed {self.health.num_failed} times"
            )
        if self.template_server is not None:
            problems += self.template_server.problems()
        if self.rss is not None and self.rss.max_growth_bytes > self.max_rss_growth_bytes:
            problems.append(
                f"resident memory grew {self.rss.max_growth_bytes / MIB:.0f} MiB after warm-up "
                f"(allowed {self.max_rss_growth_bytes / MIB:.0f} MiB)"
            )
        return problems

    @property
    def passed(self) -> bool:
        return not self.problems()

    def by_kind(self, kind: str) -> dict[str, int]:
        """Requests of ``kind``: sent, and how many got a 2xx, a 4xx, a 5xx (an error event
        in a stream counts), anything else, and an answer the kind did not expect."""
        counts = {o: n for (k, o), n in self.outcomes.items() if k == kind}
        status = {o: n for o, n in counts.items() if o.isdigit()}
        return {
            "sent": sum(counts.values()),
            "2xx": sum(n for o, n in status.items() if 200 <= int(o) < 300),
            "4xx": sum(n for o, n in status.items() if 400 <= int(o) < 500),
            "5xx": sum(n for o, n in counts.items() if is_server_error(o)),
            "unexpected": sum(n for o, n in counts.items() if not is_expected(kind, o)),
        }

    def format(self) -> str:
        table = Table(["kind", "sent", "2xx", "4xx", "5xx", "outcomes", "unexpected"])
        sent_kinds = {kind for kind, _ in self.outcomes}
        for kind in KINDS_BY_NAME:
            if kind not in sent_kinds and kind not in self.kinds:
                continue
            counts = self.by_kind(kind)
            outcomes = sorted((o, n) for (k, o), n in self.outcomes.items() if k == kind)
            listed = ", ".join(f"{o}: {n}" for o, n in outcomes) or "-"
            table.add(
                kind,
                counts["sent"],
                counts["2xx"],
                counts["4xx"],
                counts["5xx"],
                listed,
                counts["unexpected"],
            )
        lines = [
            f"soak: {self.num_requests:,} requests in {self.wall_s:.0f} s",
            table.render(),
            f"5xx on valid requests: {self.valid_5xx}",
            f"output: {self.output_tokens:,} tokens generated for valid requests, "
            f"{self.output_tokens_per_s:.1f} tok/s",
            f"KV blocks in use after the load: {_or_unknown(self.blocks_used_end)}; "
            f"sequences held: {_or_unknown(self.sequences_held_end)}; "
            f"preemptions during the run: {_or_unknown(self.preemptions)}",
            self.health.line(),
            self._rss_line(),
        ]
        if self.template_server is not None:
            lines.append(self.template_server.line())
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
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "outcomes": [
                {"kind": kind, "outcome": outcome, "count": count}
                for (kind, outcome), count in sorted(self.outcomes.items())
            ],
            "by_kind": {kind: self.by_kind(kind) for kind in sorted({k for k, _ in self.outcomes})},
            "health": {
                "probes": self.health.num_probes,
                "max_s": round(self.health.max_s, 3),
                "limit_s": self.health.limit_s,
                "slow": self.health.num_slow,
                "failed": self.health.num_failed,
            },
            "template_server": None
            if self.template_server is None
            else self.template_server.as_json(),
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
    return KINDS_BY_NAME[kind].expects(outcome)


def is_server_error(outcome: str) -> bool:
    return outcome == "error event" or (outcome.isdigit() and int(outcome) >= 500)


def _or_unknown(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}"
