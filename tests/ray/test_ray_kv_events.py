"""Each replica publishes its KV cache events on its own port (base + its rank on the node)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx
import pytest
from ray_app_fixtures import MODEL_NAME, RayApp

from kvserve.config import KVEventsConfig
from kvserve.core.block_hash import BlockHash, extend_block_hashes
from kvserve.serve.ray.engine_replica import replica_kv_events

msgspec = pytest.importorskip("msgspec", reason="the kv-events extra (msgspec) is not installed")
zmq = pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")


def test_replica_ports_are_offset_by_rank_and_free_ports_are_kept() -> None:
    events = KVEventsConfig(
        kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="tcp://10.0.0.1:6000"
    )
    second = replica_kv_events(events, 1)
    assert second.kv_events_endpoint == "tcp://*:5558"
    assert second.kv_events_replay_endpoint == "tcp://10.0.0.1:6001"
    assert replica_kv_events(events, 0) == events
    any_port = KVEventsConfig(kv_events_endpoint="tcp://127.0.0.1:*")
    assert replica_kv_events(any_port, 3) == any_port
    assert replica_kv_events(KVEventsConfig(), 2) == KVEventsConfig()


def complete(ray_app: RayApp, prompt: list[int]) -> httpx.Response:
    return httpx.post(
        f"{ray_app.url}/v1/completions",
        headers=ray_app.headers,
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )


def wait_until_every_sub_hears(ray_app: RayApp, subs: list[Any], timeout: float = 60) -> None:
    """Send one-block probe prompts until every SUB socket has had a message, then drain them.

    A SUB socket misses what is published before its subscription has reached the
    replica's PUB socket, which on a loaded machine can take longer than any fixed
    pause. Idle replicas take new prompts in turn, so the probes reach each of them.
    """
    heard = [False] * len(subs)
    deadline = time.monotonic() + timeout
    for probe in itertools.count():
        assert time.monotonic() < deadline, f"no KV event reached the subscribers {heard}"
        assert complete(ray_app, [251, 252, 5 + probe % 240, 6 + probe // 240, 7]).is_success
        for index, sub in enumerate(subs):
            while sub.poll(200 if not heard[index] else 0):
                sub.recv_multipart()
                heard[index] = True
        if all(heard):
            return


def test_the_serving_replica_publishes_the_prompt_blocks(ray_app: RayApp) -> None:
    context = zmq.Context()
    subs = []
    try:
        for endpoint in ray_app.kv_events_endpoints:
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            subs.append(sub)
        wait_until_every_sub_hears(ray_app, subs)
        prompt = list(range(300, 300 + 4 * 5 + 1))  # five full blocks of 4, and one token
        response = complete(ray_app, prompt)
        assert response.status_code == 200, response.text
        expected: list[BlockHash] = []
        extend_block_hashes(expected, prompt, 4, None)
        stored: list[list[BlockHash]] = [[] for _ in subs]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(
            set(expected) <= set(hashes) for hashes in stored
        ):
            for index, sub in enumerate(subs):
                while sub.poll(50):
                    _, _, payload = sub.recv_multipart()
                    _, events = msgspec.msgpack.decode(payload)
                    stored[index] += [h for e in events if e[0] == "BlockStored" for h in e[1]]
        holders = [index for index, hashes in enumerate(stored) if set(expected) <= set(hashes)]
        # Exactly one replica computed (and cached) this prompt, and said so.
        assert len(holders) == 1, stored
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()
