"""The disk tier's counters reach /metrics as running totals."""

from __future__ import annotations

from kvserve.core.disk_store import DiskTierCounters, DiskTierSnapshot
from kvserve.core.step_report import StepReport
from kvserve.engine.iteration_stats import IterationStats
from kvserve.entrypoints.openai.metrics import ServerMetrics


def iteration(counters: DiskTierCounters, num_bytes: int) -> IterationStats:
    report = StepReport(disk_tier=DiskTierSnapshot(counters, 3, num_bytes, True))
    return IterationStats(0, 0, 0, 10, ran_step=True, report=report)


def sample(metrics: ServerMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def test_disk_tier_counters_follow_the_step_reports() -> None:
    metrics = ServerMetrics("m")
    metrics.observe(iteration(DiskTierCounters(hits=4, loads=3, writes=5, bytes_read=300), 500))
    metrics.observe(
        iteration(DiskTierCounters(hits=6, loads=5, writes=9, evictions=2, bytes_read=300), 400)
    )
    assert sample(metrics, "kvserve_prefix_cache_disk_hits_total") == 6
    assert sample(metrics, "kvserve_prefix_cache_disk_loads_total") == 5
    assert sample(metrics, "kvserve_prefix_cache_disk_writes_total") == 9
    assert sample(metrics, "kvserve_prefix_cache_disk_evictions_total") == 2
    assert sample(metrics, "kvserve_prefix_cache_disk_bytes") == 400
    # A report without a disk tier leaves them alone.
    metrics.observe(IterationStats(0, 0, 0, 10, ran_step=True, report=StepReport()))
    assert sample(metrics, "kvserve_prefix_cache_disk_hits_total") == 6
