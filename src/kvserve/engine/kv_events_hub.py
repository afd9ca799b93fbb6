"""Where the engine's KV cache events go: a batch per step, kept and published.

The prefix cache records its changes (blocks stored, evicted, all cleared)
into the hub's :attr:`KVEventsHub.collector`; after each step the engine
calls :meth:`KVEventsHub.flush`, which turns them into one
:class:`~kvserve.core.kv_events.KVEventBatch`, keeps it for
:meth:`KVEventsHub.take` (``LLMEngine.take_kv_events``) and hands it to the
ZMQ publisher (``kv_event_publisher.py``) when an endpoint is set.
"""

from __future__ import annotations

import time
from collections import deque

from kvserve.config import KVEventsConfig
from kvserve.core.kv_events import KVEventBatch, KVEventCollector
from kvserve.engine.kv_event_publisher import ZmqKVEventPublisher


class KVEventsHub:
    """The engine's KV event collector, its last batches and its publisher (if any).

    medium: the device the KV cache lives on, as the events name it ("CPU", "GPU").
    """

    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        # None when events are off: the prefix cache then records nothing.
        self.collector = KVEventCollector(medium) if config.collects_events else None
        self._batches: deque[KVEventBatch] = deque(maxlen=config.kv_events_buffer_steps)
        self.publisher: ZmqKVEventPublisher | None = None
        if config.kv_events_endpoint is not None:
            self.publisher = ZmqKVEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_replay_endpoint,
                config.kv_events_topic,
                config.kv_events_buffer_steps,
                config.kv_events_hwm,
            )

    def take(self) -> list[KVEventBatch]:
        """The batches (one per step that changed the prefix cache) not yet taken.

        Oldest first; at most ``kv_events_buffer_steps`` are kept. Empty when
        events are off. Safe to call from another thread than the one stepping.
        """
        batches = []
        while True:
            try:
                batches.append(self._batches.popleft())
            except IndexError:
                return batches

    def flush(self) -> None:
        """Turn the events recorded since the last flush into a batch and hand it out."""
        if self.collector is None or not len(self.collector):
            return
        batch = KVEventBatch(time.time(), tuple(self.collector.take()))
        self._batches.append(batch)
        if self.publisher is not None:
            self.publisher.publish(batch)

    def shutdown(self) -> None:
        """Close the publisher's sockets (and stop its thread)."""
        if self.publisher is not None:
            self.publisher.shutdown()
