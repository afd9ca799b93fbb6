"""A batch the publisher drops is a gap its subscribers see, and the router's map
then forgets what it can no longer trust: the real publisher and subscriber over
loopback ZMQ, no cluster."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import pytest

pytest.importorskip("msgspec", reason="the kv-events extra (msgspec) is not installed")
pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")

from kvserve.core.block_hash import BlockHash, extend_block_hashes
from kvserve.core.kv_events import BlockRemoved, BlockStored, KVEventBatch
from kvserve.engine.kv_event_publisher import ZmqKVEventPublisher
from kvserve.serve.ray.kv_event_subscriber import KVEventSubscriber
from kvserve.serve.ray.replica_block_map import ReplicaBlockMap

BLOCK = 4


def _stored(first: int) -> tuple[KVEventBatch, BlockHash]:
    tokens = list(range(first, first + BLOCK))
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, BLOCK, None)
    return KVEventBatch(0.0, (BlockStored(tuple(hashes), None, tuple(tokens), BLOCK),)), hashes[0]


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_dropped_batch_empties_the_replicas_set() -> None:
    publisher = ZmqKVEventPublisher("tcp://127.0.0.1:*")
    blocks = ReplicaBlockMap()
    subscriber = KVEventSubscriber(blocks)
    try:
        subscriber.watch("r", publisher.endpoint)
        first, first_hash = _stored(10)
        # A SUB socket gets nothing sent before it joined: publish until it has.
        deadline = time.monotonic() + 10
        while blocks.longest_prefix([first_hash]) != (1, ["r"]):
            assert time.monotonic() < deadline, "the subscriber never joined"
            publisher.publish(first)
            time.sleep(0.02)
        kept, kept_hash = _stored(20)
        publisher.publish(kept)
        _wait(lambda: blocks.longest_prefix([kept_hash]) == (1, ["r"]), "the kept batch")

        def full(item: object) -> None:
            raise queue.Full

        # The next batch (which evicts the first block) is dropped: the queue is full.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(publisher._queue, "put_nowait", full)
            publisher.publish(KVEventBatch(0.0, (BlockRemoved((first_hash,)),)))
        assert publisher.num_dropped == 1
        after, after_hash = _stored(30)
        publisher.publish(after)
        _wait(lambda: blocks.longest_prefix([after_hash]) == (1, ["r"]), "the batch after")
        # Nothing from before the gap is trusted: neither the evicted block nor the kept one.
        assert blocks.num_gaps == 1
        assert blocks.longest_prefix([first_hash]) == (0, [])
        assert blocks.longest_prefix([kept_hash]) == (0, [])
    finally:
        subscriber.close()
        publisher.shutdown()


def test_an_endpoint_that_cannot_be_subscribed_to_is_forgotten() -> None:
    blocks = ReplicaBlockMap()
    subscriber = KVEventSubscriber(blocks)
    try:
        subscriber.watch("r", "not-a-transport://nowhere")
        batch, block_hash = _stored(10)
        seq = iter(range(10_000))
        # Tracked until the thread fails to connect, then dropped: batches no longer count.
        _wait(
            lambda: (
                blocks.apply("r", next(seq), batch)
                or blocks.longest_prefix([block_hash]) == (0, [])
            ),
            "the replica to be dropped",
        )
    finally:
        subscriber.close()
