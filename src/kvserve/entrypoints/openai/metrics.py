"""Prometheus metrics for ``GET /metrics``: a formatting of the async engine's iteration stats.

The gauges and request histograms come from the iteration's own numbers;
the prefix-cache counters (pool and disk tier) and speculative decoding's
counters from the step's :class:`StepReport`.

Each app owns a private ``CollectorRegistry`` (tests build several apps in one
process; the global registry would refuse the second). Metric names follow
vLLM's, with a ``kvserve_`` prefix, and carry a ``model_name`` label.
prometheus_client metrics are thread-safe, so the engine's loop thread
updates them directly.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.core.disk_store import DiskTierCounters, DiskTierSnapshot
from kvserve.core.step_report import StepReport
from kvserve.engine.iteration_stats import IterationStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The *_created series (one timestamp per counter) double the output and tell a
# scraper nothing it needs; like vLLM, leave them out. This is process-wide.
disable_created_metrics()

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# The disk tier's counters (DiskTierCounters fields) and their help texts.
_DISK_TIER_SERIES = {
    "hits": "KV blocks found in the prefix cache's disk tier past the pool's hits.",
    "loads": "KV blocks read back from the disk tier into the pool.",
    "writes": "KV blocks written to the disk tier.",
    "write_drops": "KV blocks not written to the disk tier because its queue was full.",
    "evictions": "KV block files deleted to keep the disk tier within its bound.",
    "refused": "Disk tier files found damaged, truncated, foreign or untrusted, and deleted.",
    "bytes_written": "Bytes written to the disk tier.",
    "bytes_read": "Bytes read from the disk tier.",
}


class ServerMetrics:
    """The server's metrics in their own registry; :meth:`observe` is the engine's stats observer."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(
                model_name
            )

        self.num_requests_running = gauge(
            "kvserve_num_requests_running", "Sequences in the running set."
        )
        self.num_requests_waiting = gauge(
            "kvserve_num_requests_waiting", "Sequences waiting for their first step."
        )
        self.kv_blocks_used = gauge("kvserve_kv_cache_blocks_used", "KV cache blocks in use.")
        self.kv_blocks_total = gauge(
            "kvserve_kv_cache_blocks_total", "KV cache blocks that can hold data."
        )
        self.prompt_tokens = counter(
            "kvserve_prompt_tokens", "Prompt tokens of requests that produced a first token."
        )
        self.generation_tokens = counter("kvserve_generation_tokens", "Generated tokens.")
        self.preemptions = counter("kvserve_num_preemptions", "Sequences preempted.")
        self.prefix_cache_queries = counter(
            "kvserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "kvserve_prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self._prefix_cache_seen = (0, 0)  # the step reports' totals at the last observe
        # The disk tier's cumulative counters (prefix_cache_dir), as counters of their own.
        self._disk_counters = {
            name: counter(f"kvserve_prefix_cache_disk_{name}", doc)
            for name, doc in _DISK_TIER_SERIES.items()
        }
        self.prefix_cache_disk_bytes = gauge(
            "kvserve_prefix_cache_disk_bytes", "Bytes of KV blocks the disk tier holds."
        )
        self._disk_seen = DiskTierCounters()
        self.spec_proposed_tokens = counter(
            "kvserve_spec_proposed_tokens",
            "Speculative tokens proposed and verified (speculative_config).",
        )
        self.spec_accepted_tokens = counter(
            "kvserve_spec_accepted_tokens", "Speculative tokens the verification accepted."
        )
        self.spec_acceptance_rate = gauge(
            "kvserve_spec_acceptance_rate",
            "Accepted over proposed speculative tokens since the server started (0 before any).",
        )
        self.spec_declined = counter(
            "kvserve_spec_declined",
            "Decoding requests adaptive speculation gave no proposal because the rows were "
            "expected to cost more than the tokens they would gain.",
        )
        self._spec_declined_seen = 0
        self._spec_seen = (0, 0)  # the step reports' totals at the last observe
        self.step_batch_size = histogram(
            "kvserve_iteration_batch_size",
            "Sequences in the running set during each engine step.",
            _BATCH_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "kvserve_time_to_first_token_seconds",
            "From arrival to the first generated token.",
            _LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "kvserve_inter_token_latency_seconds",
            "Between consecutive steps that gave a request tokens.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "kvserve_e2e_request_latency_seconds",
            "From arrival to the end of the request.",
            _REQUEST_BUCKETS,
        )
        self.queue_time = histogram(
            "kvserve_request_queue_time_seconds",
            "From arrival to the first step that computed the request.",
            _REQUEST_BUCKETS,
        )
        self._requests = Counter(
            "kvserve_request_success",
            "Requests that ended, by finish reason (stop, length, abort, error).",
            ["model_name", "finish_reason"],
            registry=registry,
        )
        self._model_name = model_name

    def observe(self, stats: IterationStats) -> None:
        """Record one loop iteration (called on the engine's loop thread)."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.num_kv_blocks_used)
        self.kv_blocks_total.set(stats.num_kv_blocks_total)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        if stats.ran_step:
            self.step_batch_size.observe(stats.batch_size)
        for seconds in stats.time_to_first_token:
            self.time_to_first_token.observe(seconds)
        for seconds in stats.inter_token_latency:
            self.inter_token_latency.observe(seconds)
        for seconds in stats.queue_time:
            self.queue_time.observe(seconds)
        for finished in stats.finished:
            self.e2e_latency.observe(finished.e2e_latency)
            self._requests.labels(self._model_name, finished.finish_reason).inc()
        if stats.report is not None:
            self._observe_prefix_cache(stats.report)
            self._observe_speculation(stats.report)
            if stats.report.disk_tier is not None:
                self._observe_disk_tier(stats.report.disk_tier)

    def _observe_prefix_cache(self, report: StepReport) -> None:
        """Advance the prefix-cache counters to the report's running totals."""
        seen_queries, seen_hits = self._prefix_cache_seen
        self.prefix_cache_queries.inc(report.prefix_cache_queries - seen_queries)
        self.prefix_cache_hits.inc(report.prefix_cache_hits - seen_hits)
        self._prefix_cache_seen = (report.prefix_cache_queries, report.prefix_cache_hits)

    def _observe_speculation(self, report: StepReport) -> None:
        """Advance the speculation counters to the report's running totals; the rate is
        over the engine's life, as the counters are (a scraper wanting a recent rate
        divides the counters' increases)."""
        self.spec_declined.inc(report.num_spec_declined - self._spec_declined_seen)
        self._spec_declined_seen = report.num_spec_declined
        seen_proposed, seen_accepted = self._spec_seen
        proposed, accepted = report.num_spec_proposed_tokens, report.num_spec_accepted_tokens
        if (proposed, accepted) == (seen_proposed, seen_accepted):
            return
        self.spec_proposed_tokens.inc(proposed - seen_proposed)
        self.spec_accepted_tokens.inc(accepted - seen_accepted)
        self.spec_acceptance_rate.set(accepted / proposed if proposed else 0.0)
        self._spec_seen = (proposed, accepted)

    def _observe_disk_tier(self, snapshot: DiskTierSnapshot) -> None:
        """Advance the disk tier's counters to the snapshot's running totals."""
        for name, metric in self._disk_counters.items():
            metric.inc(getattr(snapshot.counters, name) - getattr(self._disk_seen, name))
        self._disk_seen = snapshot.counters
        self.prefix_cache_disk_bytes.set(snapshot.num_bytes)

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
