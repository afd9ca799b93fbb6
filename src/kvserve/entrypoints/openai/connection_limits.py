"""uvicorn's connection settings: how many connections at once, how long a client may idle.

uvicorn limits concurrent connections and closes idle keep-alive ones, but
nothing bounds the time a client takes to send a request's head: a
connection that sends nothing, or a header line a minute, holds its place
for ever, and enough of them fill ``limit_concurrency`` so that everyone
else gets 503. :class:`_HeaderTimeoutProtocol` closes a connection whose
request head is not complete ``timeout_header`` seconds after it opened or
after its previous response ended. It extends uvicorn's h11 protocol (the
one uvicorn picks anyway when httptools is not installed), which says where
a request stands through h11's state machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.entrypoints.openai.server_config import ServerConfig


class _HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing connections slow to send a request head."""

    timeout_header: float  # seconds; set by uvicorn_options() on a subclass per server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_if_waiting()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: h11 moved to the body
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_if_waiting()  # for the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm_if_waiting(self) -> None:
        self._disarm()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.timeout_header, self._on_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run``/``uvicorn.Config`` that apply ``config``'s limits."""
    protocol = type(
        "HeaderTimeoutH11Protocol",
        (_HeaderTimeoutProtocol,),
        {"timeout_header": config.timeout_header},
    )
    return {
        "http": protocol,
        "limit_concurrency": config.limit_concurrency,
        "timeout_keep_alive": config.timeout_keep_alive,
    }
