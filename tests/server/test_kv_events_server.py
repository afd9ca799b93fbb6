"""A server started with a KV events endpoint publishes what its requests cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kv_events_fixtures import wait_until_subscribed
from kvserve.core.block_hash import BlockHash, extend_block_hashes

msgspec = pytest.importorskip("msgspec", reason="the kv-events extra (msgspec) is not installed")
zmq = pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")


def test_a_completion_publishes_its_prompt_blocks(start_tiny_server: Callable[..., Any]) -> None:
    server = start_tiny_server(
        engine_args={"kv_events_endpoint": "tcp://127.0.0.1:*", "kv_events_topic": "replica-0"}
    )
    engine = server.async_engine.engine
    publisher = engine.kv_event_publisher
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"replica-0")
        sub.connect(publisher.endpoint)
        wait_until_subscribed(sub, publisher)
        prompt = list(range(5, 5 + 4 * 3 + 1))  # three full blocks of 4, and one token
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        stored: list[BlockHash] = []
        while len(stored) < 3 and sub.poll(5000):
            _, _, payload = sub.recv_multipart()
            _, events = msgspec.msgpack.decode(payload)
            stored += [h for event in events if event[0] == "BlockStored" for h in event[1]]
        expected: list[BlockHash] = []
        extend_block_hashes(expected, prompt, 4, None)
        assert stored[:3] == expected
    finally:
        sub.close(linger=0)
        context.term()
