"""uvicorn's connections, bounded in every phase and counted per peer as well as in total.

A connection slot is what a hostile client can hold without computing
anything, so no phase of a connection may hold one for ever, and no one
address may hold many:

- **request head**: it must be complete ``timeout_header`` seconds after the
  connection opened or after its previous response ended;
- **request body**: once the head is in, the body must arrive within
  ``timeout_body`` seconds, plus one second for every ``min_body_rate`` bytes
  received (counted up to ``max_request_body_bytes``): a stalled body is cut
  after ``timeout_body`` seconds, a trickle slower than ``min_body_rate`` a
  little later, and no body, however fast, holds a slot longer than
  ``timeout_body + max_request_body_bytes / min_body_rate``. The client gets
  408 (OpenAI's error body) when no response has started yet;
- **response**: a client that reads nothing of a response for
  ``timeout_write`` seconds while the server has bytes waiting for it (its
  receive window is shut) is disconnected;
- **idle keep-alive**: uvicorn closes it after ``timeout_keep_alive``.

Counting: a peer (an IPv4 address, or an IPv6 /64, which one host usually
owns whole) holds at most ``limit_concurrency_per_peer`` admitted
connections, its oldest; a request on any newer connection of that peer gets
503 and the connection is closed. Past ``limit_concurrency`` admitted
connections in all, every new request gets 503. Both refusals are OpenAI's
error body with ``Retry-After``, and both let ``GET /health`` through, so a
load balancer's probe still sees a live server. A peer's connections past its
cap do not count in the total: one address, however many sockets it opens,
takes at most its cap of the server's slots.

:class:`GuardedH11Protocol` extends uvicorn's h11 protocol (the one uvicorn
picks anyway when httptools is not installed), which says where a request
stands through h11's state machine; :func:`uvicorn_options` makes a subclass
of it per server, with that server's settings and counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.entrypoints.openai.access_log import BODY_TIMEOUT_SCOPE_KEY
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.auth import OPEN_PATHS
from kvserve.entrypoints.openai.server_config import ServerConfig

logger = logging.getLogger(__name__)

# Seconds between two warnings about refused connections (each sums up those since the last).
_REFUSAL_LOG_INTERVAL = 10.0


def peer_key(client: tuple[str, int] | None) -> str:
    """The address a connection is counted under: its IPv4 address, or its IPv6 /64."""
    if client is None:
        return "unix"  # a Unix socket: every client is the same local peer
    host = client[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return str(address)


class _Peer:
    """One address's connections: the admitted ones (at most the cap), then the rest in order."""

    __slots__ = ("admitted", "waiting")

    def __init__(self) -> None:
        self.admitted: set[object] = set()
        self.waiting: dict[object, None] = {}  # insertion-ordered: the oldest first


class ConnectionCounts:
    """The connections of one server, per peer and in total (on its event loop only)."""

    def __init__(self, limit_concurrency: int, limit_per_peer: int) -> None:
        self.limit_concurrency = limit_concurrency
        self.limit_per_peer = limit_per_peer
        self.peers: dict[str, _Peer] = {}
        self.num_admitted = 0
        self._refused = 0
        self._last_warning = -_REFUSAL_LOG_INTERVAL

    def connect(self, connection: object, key: str) -> None:
        peer = self.peers.setdefault(key, _Peer())
        if len(peer.admitted) < self.limit_per_peer:
            peer.admitted.add(connection)
            self.num_admitted += 1
        else:
            peer.waiting[connection] = None

    def disconnect(self, connection: object, key: str) -> None:
        peer = self.peers.get(key)
        if peer is None:
            return
        if connection in peer.admitted:
            peer.admitted.discard(connection)
            if peer.waiting:  # the peer's oldest connection past its cap takes the place
                promoted = next(iter(peer.waiting))
                del peer.waiting[promoted]
                peer.admitted.add(promoted)
            else:
                self.num_admitted -= 1
        else:
            peer.waiting.pop(connection, None)
        if not peer.admitted and not peer.waiting:
            del self.peers[key]

    def refusal(self, connection: object, key: str) -> ApiError | None:
        """The 503 a request on ``connection`` gets, or None if it may go on."""
        peer = self.peers.get(key)
        if peer is not None and connection not in peer.admitted:
            error = ApiError(
                503,
                f"Too many open connections from your address (more than "
                f"{self.limit_per_peer}); close some, or retry later.",
                code="too_many_connections",
                headers={"Retry-After": "1", "Connection": "close"},
            )
            self._note_refusal(f"{key} has more than {self.limit_per_peer} connections")
            return error
        if self.num_admitted > self.limit_concurrency:
            error = ApiError(
                503,
                f"The server has too many open connections (more than "
                f"{self.limit_concurrency}); retry later.",
                code="too_many_connections",
                headers={"Retry-After": "1", "Connection": "close"},
            )
            self._note_refusal(f"more than {self.limit_concurrency} connections in all")
            return error
        return None

    def _note_refusal(self, why: str) -> None:
        # One line per interval at most: a flood of refusals must not flood the log.
        self._refused += 1
        now = time.monotonic()
        if now - self._last_warning >= _REFUSAL_LOG_INTERVAL:
            logger.warning(
                "refused %d request(s) with 503 past the connection limits (latest: %s)",
                self._refused,
                why,
            )
            self._refused = 0
            self._last_warning = now


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with each phase of a connection bounded and counted.

    The class attributes are set by :func:`uvicorn_options` on a subclass per server.
    """

    counts: ConnectionCounts
    timeout_header: float
    timeout_body: float
    min_body_rate: float  # bytes per second
    max_body_bytes: int
    timeout_write: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inner_app = self.app
        self.app = self._admit

    # Connection events (uvicorn's, extended)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_bytes = 0
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_buffered = 0
        super().connection_made(transport)
        self._peer = peer_key(self.client)
        self.counts.connect(self, self._peer)
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes += len(data)
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()  # for the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        self._cancel_write_timer()
        self.counts.disconnect(self, self._peer)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_write_timer()

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    # Admission: the connection counts, checked when a request's head is in

    async def _admit(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            refusal = self.counts.refusal(self, self._peer)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self._inner_app(scope, receive, send)

    # The request's phases: head, then body

    def _watch(self) -> None:
        """Run the timer of the phase the request is in (none once it is all in)."""
        state = self.conn.their_state
        if self.transport.is_closing():
            phase = None
        elif state is h11.IDLE:
            phase = "head"
        elif state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = None
        if phase != self._phase:
            self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase == "head":
            self._timer = self.loop.call_later(self.timeout_header, self._on_head_timeout)
        elif phase == "body":
            self._body_started = self.loop.time()
            self._body_bytes = 0
            self._timer = self.loop.call_later(self.timeout_body, self._on_body_timer)

    def _on_head_timeout(self) -> None:
        self._timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def _body_deadline(self) -> float:
        counted = min(self._body_bytes, self.max_body_bytes)
        return self._body_started + self.timeout_body + counted / self.min_body_rate

    def _on_body_timer(self) -> None:
        self._timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # The server stopped reading (the app has not taken what came): not the
            # client's fault, so its time starts again once reading resumes.
            self._body_started, self._body_bytes = now, 0
            self._timer = self.loop.call_later(self.timeout_body, self._on_body_timer)
            return
        deadline = self._body_deadline()
        if now < deadline:  # the body kept pace: wait for the new deadline
            self._timer = self.loop.call_later(deadline - now, self._on_body_timer)
            return
        self._time_out_body()

    def _time_out_body(self) -> None:
        """A 408 if no response has started, then close; the app sees a disconnect."""
        cycle = self.cycle
        if cycle is not None:
            self.scope[BODY_TIMEOUT_SCOPE_KEY] = True  # type: ignore[literal-required]
            if not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
                error = ApiError(
                    408,
                    f"The request body did not arrive in time ({self.timeout_body:g} s, plus "
                    f"1 s per {self.min_body_rate:g} bytes received).",
                    code="request_timeout",
                )
                body = json.dumps(error.body()).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ]
                with contextlib.suppress(h11.LocalProtocolError):
                    self.transport.write(
                        self.conn.send(h11.Response(status_code=408, headers=headers))
                        + self.conn.send(h11.Data(data=body))
                        + self.conn.send(h11.EndOfMessage())
                    )
            # The app's response, if it ever makes one, goes nowhere; its body read ends.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    # The response: a client that reads nothing of it

    def _arm_write_timer(self) -> None:
        if self._write_timer is None and not self.transport.is_closing():
            self._write_buffered = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self.timeout_write, self._on_write_timer)

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _on_write_timer(self) -> None:
        self._write_timer = None
        if self.transport.is_closing() or not self.flow.write_paused:
            return
        buffered = self.transport.get_write_buffer_size()
        if buffered < self._write_buffered:  # the client read some: give it another period
            self._arm_write_timer()
            return
        self.transport.abort()  # close() would wait for the buffer to drain: for ever


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run``/``uvicorn.Config`` that apply ``config``'s limits.

    ``limit_concurrency`` is counted by :class:`GuardedH11Protocol`, not by uvicorn (whose
    503 is plain text, refuses /health too and knows no peers).
    """
    protocol = type(
        "GuardedH11ProtocolForServer",
        (GuardedH11Protocol,),
        {
            "counts": ConnectionCounts(config.limit_concurrency, config.limit_concurrency_per_peer),
            "timeout_header": config.timeout_header,
            "timeout_body": config.timeout_body,
            "min_body_rate": float(config.min_body_rate),
            "max_body_bytes": config.max_request_body_bytes,
            "timeout_write": config.timeout_write,
        },
    )
    return {"http": protocol, "timeout_keep_alive": config.timeout_keep_alive}
