"""Publishes KV event batches over ZMQ, in the wire format of vLLM's KV events
(and :func:`decode_batch` reads that format back, for subscribers).

One message per engine step that changed the prefix cache, on a PUB socket::

    [topic, sequence number (8 bytes, big-endian, from 0), msgpack payload]

The payload is vLLM's ``KVEventBatch`` as msgspec encodes it (array-like
structs, events tagged by class name)::

    [ts, [event, ...]]
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are 32-byte SHA-256 digests (msgpack bin). A subscriber that
notices a gap in the sequence numbers asks the ROUTER replay socket for the
batches from ``start``: it sends one frame, ``start`` as 8 big-endian bytes
(a REQ socket, or a DEALER sending an empty delimiter first), and gets back
``[seq, payload]`` for every kept batch from ``start`` on, then
``[-1 as 8 signed big-endian bytes, b""]``.

A background thread owns the sockets (ZMQ sockets belong to one thread):
:meth:`publish` only queues, so the engine's step never waits on the network.
A full queue drops the batch and counts it; subscribers see the gap.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

from kvserve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from kvserve.errors import InvalidParameterError

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Batches waiting for the thread; past this the engine outruns the network.
MAX_QUEUED_BATCHES = 100_000
_STOP = object()


def import_kv_events_extra() -> tuple[Any, Any]:
    """``(zmq, msgspec)``, or an ImportError that names the extra to install."""
    try:
        import msgspec
        import zmq
    except ImportError as exc:
        raise ImportError(
            f"publishing KV cache events needs pyzmq and msgspec ({exc.name} is missing): "
            "pip install 'kvserve[kv-events]'"
        ) from exc
    return zmq, msgspec


def event_as_array(event: KVCacheEvent) -> list[Any]:
    """One event as vLLM's tagged, array-like struct: the class name, then the fields."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    return ["BlockRemoved", list(event.block_hashes), event.medium]


def encode_batch(batch: KVEventBatch, msgspec: Any) -> bytes:
    """The msgpack payload of one batch."""
    return bytes(msgspec.msgpack.encode([batch.ts, [event_as_array(e) for e in batch.events]]))


def decode_batch(payload: bytes, msgspec: Any) -> KVEventBatch:
    """The batch :func:`encode_batch` wrote (or a vLLM publisher sent); ValueError when
    the payload is not one."""
    try:
        ts, raw_events = msgspec.msgpack.decode(payload)
        events: list[KVCacheEvent] = []
        for raw in raw_events:
            tag, fields = raw[0], raw[1:]
            if tag == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium = fields
                events.append(
                    BlockStored(
                        tuple(hashes), parent, tuple(token_ids), block_size, lora_id, medium
                    )
                )
            elif tag == "BlockRemoved":
                events.append(BlockRemoved(tuple(fields[0]), fields[1]))
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown KV event {tag!r}")
    except (TypeError, IndexError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from exc
    return KVEventBatch(float(ts), tuple(events))


class ZmqKVEventPublisher:
    """Binds a PUB socket (and optionally a ROUTER replay socket) and sends batches.

    endpoint, replay_endpoint: ZMQ addresses to bind (``tcp://*:5557``); a
        port of ``*`` picks a free one, and the attributes of the same names
        then say which.
    topic: the first frame of every message; subscribers filter on it.
    buffer_steps: how many recent batches the replay socket can resend.
    hwm: messages ZMQ queues per subscriber before dropping.

    Raises InvalidParameterError, naming the endpoint, if a socket cannot bind.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self._zmq, self._msgspec = import_kv_events_extra()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.num_published = 0
        self.num_dropped = 0
        self._next_seq = 0
        self._queue: queue.Queue[Any] = queue.Queue(MAX_QUEUED_BATCHES)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = self._zmq.Context()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(endpoint, replay_endpoint, hwm),
            name="kvserve-kv-events",
            daemon=True,
        )
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            self._context.term()
            raise self._start_error

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch for sending; never blocks (a full queue drops it)."""
        # Numbered here, dropped or not: a dropped batch leaves a gap subscribers see.
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV event queue full: a batch was dropped (%d so far)", self.num_dropped)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._context.term()

    # ------------------------------------------------------- publisher thread

    def _run(self, endpoint: str, replay_endpoint: str | None, hwm: int) -> None:
        zmq = self._zmq
        pub = self._context.socket(zmq.PUB)
        replay = self._context.socket(zmq.ROUTER) if replay_endpoint is not None else None
        param = "kv_events_endpoint"
        try:
            pub.setsockopt(zmq.SNDHWM, hwm)
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay is not None:
                param = "kv_events_replay_endpoint"
                replay.bind(replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            address = endpoint if param == "kv_events_endpoint" else replay_endpoint
            self._start_error = InvalidParameterError(param, f"cannot bind {address!r}: {exc}")
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            self._started.set()
            return
        self._started.set()
        try:
            self._serve(pub, replay)
        finally:
            pub.close(linger=1000)
            if replay is not None:
                replay.close(linger=0)

    def _serve(self, pub: Any, replay: Any) -> None:
        """Send queued batches; between them, answer replay requests."""
        while True:
            if replay is not None and replay.poll(0):
                self._answer_replay(replay)
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            seq, batch = item
            payload = encode_batch(batch, self._msgspec)
            pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _answer_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, delimiter, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                replay.send_multipart((client, delimiter, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, delimiter, END_OF_REPLAY, b""))
