"""Speculative decoding's counters reach /metrics as running totals, with their rate."""

from __future__ import annotations

import pytest
from test_disk_tier_metrics import sample

from kvserve.core.step_report import StepReport
from kvserve.engine.iteration_stats import IterationStats
from kvserve.entrypoints.openai.metrics import ServerMetrics


def iteration(proposed: int, accepted: int) -> IterationStats:
    report = StepReport(num_spec_proposed_tokens=proposed, num_spec_accepted_tokens=accepted)
    return IterationStats(0, 0, 0, 10, ran_step=True, report=report)


def test_speculation_counters_follow_the_step_reports() -> None:
    metrics = ServerMetrics("m")
    # Before any proposal: zero counters and rate, present so dashboards find them.
    metrics.observe(iteration(0, 0))
    assert sample(metrics, "kvserve_spec_proposed_tokens_total") == 0
    assert sample(metrics, "kvserve_spec_acceptance_rate") == 0
    metrics.observe(iteration(10, 4))
    metrics.observe(iteration(30, 21))
    # The reports' totals, not their sum: 30 and 21, not 40 and 25.
    assert sample(metrics, "kvserve_spec_proposed_tokens_total") == 30
    assert sample(metrics, "kvserve_spec_accepted_tokens_total") == 21
    assert sample(metrics, "kvserve_spec_acceptance_rate") == pytest.approx(0.7)
    # An iteration that ran no step leaves them as they were.
    metrics.observe(IterationStats(0, 0, 0, 10, ran_step=False, report=None))
    assert sample(metrics, "kvserve_spec_accepted_tokens_total") == 21
    assert sample(metrics, "kvserve_spec_acceptance_rate") == pytest.approx(0.7)


def test_requests_declined_by_adaptive_speculation_are_counted() -> None:
    metrics = ServerMetrics("m")
    metrics.observe(iteration(0, 0))
    assert sample(metrics, "kvserve_spec_declined_total") == 0
    for declined in (3, 3, 7):  # running totals, with a step that declined none
        report = StepReport(num_spec_declined=declined)
        metrics.observe(IterationStats(0, 0, 0, 10, ran_step=True, report=report))
    assert sample(metrics, "kvserve_spec_declined_total") == 7
