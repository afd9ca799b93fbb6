"""KV event batches on the wire: what a vLLM-style subscriber receives over ZMQ.

The payloads are decoded with the struct definitions a vLLM consumer uses
(written out here, independently of the publisher's encoder) and compared
with the batches the engine hands out in process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvserve.engine.kv_event_publisher import ZmqKVEventPublisher
from kvserve.errors import InvalidParameterError

msgspec = pytest.importorskip("msgspec", reason="the kv-events extra (msgspec) is not installed")
zmq = pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")

from kv_events_fixtures import PARAMS, make_engine, wait_until_subscribed, workload  # noqa: E402
from model_fixtures import save_tiny_model, train_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """vLLM's base event: an array whose first element is the class name."""


class Stored(Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class Removed(Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class Cleared(Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Stored | Removed | Cleared]


def as_plain(decoded: Any) -> list[tuple[Any, ...]]:
    """A decoded batch's events as tuples comparable with kvserve's dataclasses."""
    plain = []
    for event in decoded.events:
        fields = [getattr(event, name) for name in event.__struct_fields__]
        values = [tuple(value) if isinstance(value, list) else value for value in fields]
        plain.append((type(event).__name__, *values))
    return plain


def expected_plain(batch: KVEventBatch) -> list[tuple[Any, ...]]:
    names = {BlockStored: "Stored", BlockRemoved: "Removed", AllBlocksCleared: "Cleared"}
    return [
        (names[type(event)], *(getattr(event, f) for f in event.__dataclass_fields__))
        for event in batch.events
    ]


def test_subscriber_decodes_consecutive_batches_and_replays_missed_ones(model_dir: Path) -> None:
    decoder = msgspec.msgpack.Decoder(Batch)
    engine = make_engine(
        model_dir,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic="kv",
    )
    publisher = engine.kv_event_publisher
    assert publisher is not None
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    replay = context.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(publisher.endpoint)
        replay.connect(publisher.replay_endpoint)
        first_seq = wait_until_subscribed(sub, publisher)  # the probes took 0..first_seq-1
        for index, prompt in enumerate(workload(2)):
            engine.add_request(str(index), {"prompt_token_ids": prompt}, PARAMS)
        while engine.has_unfinished_requests():
            engine.step()
        batches = engine.take_kv_events()
        assert len(batches) > 5
        received = []
        while len(received) < len(batches) and sub.poll(5000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            received.append((int.from_bytes(seq, "big"), payload))
        assert [seq for seq, _ in received] == list(range(first_seq, first_seq + len(batches)))
        for (_, payload), batch in zip(received, batches, strict=True):
            decoded = decoder.decode(payload)
            assert decoded.ts == batch.ts
            assert as_plain(decoded) == expected_plain(batch)
        # A subscriber that saw nothing after batch 2 asks for the rest.
        replay.send_multipart([b"", (first_seq + 3).to_bytes(8, "big")])
        replayed = []
        while replay.poll(5000):
            _, seq, payload = replay.recv_multipart()
            if payload == b"":
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == received[3:]
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        context.term()
        engine.shutdown()


def test_an_endpoint_in_use_is_refused_by_name() -> None:
    first = ZmqKVEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(InvalidParameterError, match="kv_events_replay_endpoint"):
            ZmqKVEventPublisher("tcp://127.0.0.1:*", replay_endpoint=first.endpoint)
    finally:
        first.shutdown()
