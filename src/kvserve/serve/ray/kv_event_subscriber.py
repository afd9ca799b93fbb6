"""A background thread that reads the replicas' KV event streams into a ReplicaBlockMap.

One ZMQ SUB socket per watched replica (its endpoint comes from the replica
itself, so replicas on any node are reached where they publish). ZMQ sockets
belong to one thread: :meth:`KVEventSubscriber.watch` and
:meth:`KVEventSubscriber.unwatch` only queue the change, and the thread opens
or closes the socket between polls. Unwatching forgets the replica's blocks at
once, so the router never prefers a replica it no longer routes to.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Hashable
from typing import Any

from kvserve.engine.kv_event_publisher import decode_batch, import_kv_events_extra
from kvserve.serve.ray.replica_block_map import ReplicaBlockMap

logger = logging.getLogger(__name__)

POLL_MS = 50
_STOP = object()


class KVEventSubscriber:
    """Feeds ``block_map`` from each watched replica's PUB socket.

    topic: the topic the replicas publish under (``kv_events_topic``).
    """

    def __init__(self, block_map: ReplicaBlockMap, topic: str = "") -> None:
        self._zmq, self._msgspec = import_kv_events_extra()
        self.block_map = block_map
        self._topic = topic.encode("utf-8")
        self._changes: queue.Queue[Any] = queue.Queue()
        self._context = self._zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-subscriber", daemon=True)
        self._thread.start()

    def watch(self, replica: Hashable, endpoint: str) -> None:
        """Subscribe to ``replica``'s events at ``endpoint`` (its set starts empty)."""
        self.block_map.add_replica(replica)
        self._changes.put((replica, endpoint))

    def unwatch(self, replica: Hashable) -> None:
        """Stop reading ``replica`` and forget its blocks."""
        self.block_map.drop_replica(replica)
        self._changes.put((replica, None))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close its sockets."""
        self._changes.put(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._context.term()

    # ------------------------------------------------------- subscriber thread

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        sockets: dict[Hashable, Any] = {}
        owners: dict[Any, Hashable] = {}
        try:
            while True:
                while not self._changes.empty():
                    change = self._changes.get()
                    if change is _STOP:
                        return
                    replica, endpoint = change
                    old = sockets.pop(replica, None)
                    if old is not None:
                        poller.unregister(old)
                        del owners[old]
                        old.close(linger=0)
                    if endpoint is not None:
                        sub = self._context.socket(zmq.SUB)
                        try:
                            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                            sub.connect(endpoint)
                        except zmq.ZMQError as exc:
                            logger.warning(
                                "cannot subscribe to %s at %r: %s", replica, endpoint, exc
                            )
                            sub.close(linger=0)
                            self.block_map.drop_replica(replica)
                            continue
                        poller.register(sub, zmq.POLLIN)
                        sockets[replica] = sub
                        owners[sub] = replica
                for sub, _ in poller.poll(POLL_MS):
                    self._drain(owners[sub], sub)
        except Exception:
            logger.exception("the KV event subscriber stopped")
            raise
        finally:
            # Nothing updates the sets any more: forget them rather than route on them.
            for replica, sub in sockets.items():
                self.block_map.drop_replica(replica)
                sub.close(linger=0)

    def _drain(self, replica: Hashable, sub: Any) -> None:
        """Apply every message waiting on ``sub``."""
        zmq = self._zmq
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise ValueError(f"{len(frames)} frames")
                batch = decode_batch(frames[2], self._msgspec)
            except ValueError as exc:
                # What it said is lost: the set could name evicted blocks.
                logger.warning("unreadable KV event message from %s (%s)", replica, exc)
                self.block_map.reset(replica)
                continue
            self.block_map.apply(replica, int.from_bytes(frames[1], "big"), batch)
