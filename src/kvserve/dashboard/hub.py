"""Frames to browsers: one latest-value slot per client, so nobody waits on anybody.

The engine's loop thread hands a frame to :meth:`StateHub.publish_threadsafe`,
which only schedules :meth:`StateHub.publish` on the event loop and returns.
There the frame is encoded once, as one Server-Sent Event, and offered to
every client: an offer overwrites the client's slot and sets its event, so a
client that reads slowly (or not at all) skips frames instead of queueing
them. Nothing the hub does waits on a client, and memory per client is one
frame at most. Each client also gets at most one frame per ``min_interval_s``:
the sampler already publishes at most ~10 a second while the engine works,
but a frame it must send when the engine goes idle comes whenever that is.

A client is removed when its stream ends: the browser closed it, a send
failed, or :meth:`StateHub.close` ended every stream (the server is shutting
down, and would otherwise wait for ever on streams that never end). A heartbeat comment every
``heartbeat_s`` seconds makes a silently closed connection fail a send even
while no frames flow (an idle engine publishes nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvserve.dashboard.state import Frame

_HEARTBEAT = b": keep-alive\n\n"
_RETRY = b"retry: 1000\n\n"


class _Client:
    """One browser's stream: the newest frame it has not sent yet, and a wake-up."""

    __slots__ = ("event", "slot")

    def __init__(self) -> None:
        self.slot: bytes | None = None
        self.event = asyncio.Event()

    def offer(self, event: bytes) -> None:
        self.slot = event  # an unsent older frame is dropped: only the newest matters
        self.event.set()


class StateHub:
    """Holds the latest frame and the connected clients; lives on one event loop.

    min_interval_s: a client gets at most one frame per this many seconds
        (the newest when the time comes), however often frames are published.
    heartbeat_s: seconds of silence after which a client gets a comment line.
    extra: called when a frame is encoded; its dict is merged into the frame
        (server-side facts the engine does not know, such as the built-in load).
    """

    def __init__(
        self,
        min_interval_s: float = 0.1,
        heartbeat_s: float = 15.0,
        extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.extra = extra
        self.latest: Frame | None = None
        self._latest_event: bytes | None = None
        self._clients: set[_Client] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # Read by the engine's loop thread: a plain int, so no lock is needed.
        self.num_clients = 0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the loop that serves the clients; frames published before are dropped."""
        self._loop = loop

    def has_watchers(self) -> bool:
        return self.num_clients > 0

    def publish_threadsafe(self, frame: Frame) -> None:
        """Queue ``frame`` for :meth:`publish` on the hub's loop; returns at once, from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # RuntimeError: the loop closed between the check and the call.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self.publish, frame)

    def publish(self, frame: Frame) -> None:
        """Make ``frame`` the latest and offer it to every client (on the hub's loop)."""
        self.latest = frame
        self._latest_event = self._encode(frame)
        for client in self._clients:
            client.offer(self._latest_event)

    def refresh(self) -> None:
        """Re-send the latest frame with fresh ``extra`` facts (the load started or ended)."""
        if self.latest is not None:
            self.publish(self.latest)

    def close(self) -> None:
        """End every stream now and refuse new ones (they end at once); on the hub's loop."""
        self._closed = True
        for client in self._clients:
            client.event.set()

    def _encode(self, frame: Frame) -> bytes:
        payload: dict[str, Any] = dict(frame)
        if self.extra is not None:
            payload.update(self.extra())
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    async def events(self) -> AsyncIterator[bytes]:
        """A client's stream of Server-Sent Events: the latest frame, then each newer one.

        The client is registered while the iterator runs and removed when it
        closes (the response ended or was cancelled).
        """
        client = _Client()
        self._clients.add(client)
        self.num_clients = len(self._clients)
        try:
            yield _RETRY  # how soon a browser reconnects after the stream breaks
            if self._latest_event is not None:
                client.offer(self._latest_event)
            loop = asyncio.get_running_loop()
            next_send = loop.time()
            while not self._closed:
                try:
                    await asyncio.wait_for(client.event.wait(), self.heartbeat_s)
                except asyncio.TimeoutError:
                    yield _HEARTBEAT
                    continue
                # Newer frames landing in the slot meanwhile replace this one.
                await asyncio.sleep(max(next_send - loop.time(), 0.0))
                client.event.clear()
                if self._closed:
                    break
                event, client.slot = client.slot, None
                if event is not None:
                    yield event
                    next_send = loop.time() + self.min_interval_s
        finally:
            self._clients.discard(client)
            self.num_clients = len(self._clients)
