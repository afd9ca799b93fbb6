"""``KVEventsConfig``: whether KV cache events are collected, and where they are published.

One of the groups :class:`~kvserve.config.engine.EngineConfig` holds; the
engine's ``engine/kv_events_hub.py`` reads it (docs/kv_events.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.checks import require, require_positive_int


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events: blocks entering and leaving the prefix cache (docs/kv_events.md).

    enable_kv_cache_events: collect each step's events for in-process readers
        (LLMEngine.take_kv_events); implied by kv_events_endpoint.
    kv_events_endpoint: publish each step's events on a ZMQ PUB socket bound
        here (such as tcp://*:5557), in vLLM's wire format; needs the
        kv-events extra. Unset: nothing is published.
    kv_events_replay_endpoint: a ZMQ ROUTER socket bound here resends the
        last kv_events_buffer_steps batches to subscribers that missed some.
    kv_events_topic: the topic frame of every published message.
    kv_events_buffer_steps: batches kept for replay, and for take_kv_events
        (the oldest are dropped when nobody takes them).
    kv_events_hwm: ZMQ high-water mark: messages queued per subscriber
        before the socket drops new ones.
    """

    enable_kv_cache_events: bool = False
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000

    def __post_init__(self) -> None:
        require(
            isinstance(self.enable_kv_cache_events, bool),
            "enable_kv_cache_events",
            f"must be True or False, got {self.enable_kv_cache_events!r}",
        )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, str) and "://" in value),
                name,
                f"must be a ZMQ endpoint such as tcp://*:5557, got {value!r}",
            )
        require(
            self.kv_events_replay_endpoint is None or self.kv_events_endpoint is not None,
            "kv_events_replay_endpoint",
            "replays published batches, so it needs kv_events_endpoint too",
        )
        require(
            isinstance(self.kv_events_topic, str),
            "kv_events_topic",
            f"must be a string, got {self.kv_events_topic!r}",
        )
        require_positive_int(self.kv_events_buffer_steps, "kv_events_buffer_steps")
        require_positive_int(self.kv_events_hwm, "kv_events_hwm")

    @property
    def collects_events(self) -> bool:
        """Whether the engine collects events at all (off: the pool builds none)."""
        return self.enable_kv_cache_events or self.kv_events_endpoint is not None
