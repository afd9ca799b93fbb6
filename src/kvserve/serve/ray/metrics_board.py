"""Replicas' Prometheus metrics, gathered for the ingress's ``/metrics``.

Each engine replica renders its own ``ServerMetrics`` and publishes the text to
a named board actor (:class:`MetricsBoard`, one per app, no CPU reserved):
within ``PUBLISH_INTERVAL_S`` of a change, and every ``HEARTBEAT_S`` anyway. The
ingress reads the board and serves every series twice: summed over the
replicas (the labels of the single-process server), and per replica with a
``replica`` label. A replica that stopped publishing (it died) drops out after
``STALE_AFTER_S``. Pushing keeps the ingress independent of how requests are
routed: a DeploymentHandle cannot address one replica.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import ray
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.2
HEARTBEAT_S = 2.0
STALE_AFTER_S = 10.0
BOARD_NAMESPACE = "kvserve"


class MetricsBoard:
    """The latest metrics text of each replica (a Ray actor)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def snapshot(self) -> dict[str, str]:
        """Replica id → metrics text, for replicas heard from in the last STALE_AFTER_S."""
        now = time.monotonic()
        self._texts = {r: (t, x) for r, (t, x) in self._texts.items() if now - t < STALE_AFTER_S}
        return {replica: text for replica, (_, text) in self._texts.items()}


def board_actor(name: str) -> ray.actor.ActorHandle:
    """The app's board, created by whichever process asks first. Detached, so it does not
    die with the replica that created it; ``kvserve serve --ray`` removes it at shutdown."""
    remote_board: Any = ray.remote(num_cpus=0)(MetricsBoard)
    return cast(
        ray.actor.ActorHandle,
        remote_board.options(
            name=name, namespace=BOARD_NAMESPACE, get_if_exists=True, lifetime="detached"
        ).remote(),
    )


class MetricsPublisher:
    """A replica's side: a daemon thread pushing ``render()`` to the board."""

    def __init__(self, board_name: str, replica: str, render: Callable[[], bytes]) -> None:
        self._board = board_actor(board_name)
        self._replica = replica
        self._render = render
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-metrics", daemon=True)
        self._thread.start()

    def mark_changed(self) -> None:
        """Called on the engine loop thread after each iteration."""
        self._changed.set()

    def _run(self) -> None:
        last_push = 0.0
        while True:
            time.sleep(PUBLISH_INTERVAL_S)
            if self._changed.is_set() or time.monotonic() - last_push > HEARTBEAT_S:
                self._changed.clear()
                try:
                    self._board.put.remote(self._replica, self._render().decode())
                except Exception:  # the board is gone (app shutting down): try again later
                    logger.debug("publishing metrics failed", exc_info=True)
                last_push = time.monotonic()


def aggregate(texts: dict[str, str]) -> list[Metric]:
    """Each replica's series with a ``replica`` label, then their sums without it."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            totals = sums.setdefault(family.name, {})
            for sample in family.samples:
                labelled = dict(sample.labels, replica=replica)
                merged.samples.append(Sample(sample.name, labelled, sample.value))
                key = (sample.name, tuple(sorted(sample.labels.items())))
                totals[key] = totals.get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in sums[name].items():
            family.samples.append(Sample(sample_name, dict(labels), value))
    return list(families.values())


def render(texts: dict[str, str]) -> bytes:
    """:func:`aggregate` in Prometheus' text format."""
    from prometheus_client import generate_latest

    class _Collector:
        def collect(self) -> list[Metric]:
            return aggregate(texts)

    return generate_latest(cast(Any, _Collector()))
