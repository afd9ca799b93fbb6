"""KV-aware routing on a cluster: requests follow what the replicas' events say they cache.

A second, small app shares the session's Serve proxy under ``/kv-aware``: two
replicas of the tiny model with a small KV cache (64 blocks of 4 tokens), kv-aware
routing, events on. The test watches the same event streams the router reads
(with the router's own subscriber and block map, keyed by the replica's rank) to
learn where each request ran and what each replica evicted.

A shared prefix first follows the replica that announced it. Then that replica
evicts it (fresh prompts fill both caches) and is kept busy with one long
request: the prefix router would still send the prefix there (it remembers
where it sent it, and one call in flight is far from saturation); the kv-aware
router knows nobody holds it and sends it to the idle replica.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")
pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")

from ray_app_fixtures import ENGINE_ARGS, MODEL_NAME, RayApp, free_port_run

from kvserve.core.block_hash import BlockHash, extend_block_hashes
from kvserve.serve.ray.kv_event_subscriber import KVEventSubscriber
from kvserve.serve.ray.replica_block_map import ReplicaBlockMap
from model_fixtures import TINY_CHAT_TEMPLATE

ROUTE = "/kv-aware"
BLOCK = ENGINE_ARGS["block_size"]
KV_ARGS: dict[str, Any] = {**ENGINE_ARGS, "num_blocks": 64, "max_model_len": 256}
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def kv_app(ray_app: RayApp, tiny_model_dir: Path) -> Iterator[RayApp]:
    """The kv-aware app, on ``ray_app``'s proxy, with its replicas' event endpoints."""
    from ray import serve

    from kvserve.config import EngineConfig
    from kvserve.entrypoints.openai.server_config import ServerConfig
    from kvserve.serve.ray.app import RayServeOptions, build_application
    from kvserve.serve.ray.local_cluster import undeploy

    port = free_port_run(2)
    options = RayServeOptions(replicas=2, routing="kv-aware", app_name="kvserve-kv-aware")
    engine_config = EngineConfig.from_kwargs(
        str(tiny_model_dir), **KV_ARGS, kv_events_endpoint=f"tcp://127.0.0.1:{port}"
    )
    app = build_application(engine_config, ServerConfig(MODEL_NAME), options, TINY_CHAT_TEMPLATE)
    try:
        serve.run(app, name=options.app_name, route_prefix=ROUTE)
        endpoints = tuple(f"tcp://127.0.0.1:{port + rank}" for rank in range(2))
        yield RayApp(ray_app.url + ROUTE, {}, endpoints)
    finally:
        undeploy(options)


@pytest.fixture
def watched(kv_app: RayApp) -> Iterator[ReplicaBlockMap]:
    """Each replica's cached blocks as its events tell, keyed by its rank (0, 1)."""
    blocks = ReplicaBlockMap()
    subscriber = KVEventSubscriber(blocks)
    for rank, endpoint in enumerate(kv_app.kv_events_endpoints):
        subscriber.watch(rank, endpoint)
    yield blocks
    subscriber.close()


def _hashes(tokens: list[int]) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, BLOCK, None)
    return hashes


def _complete(app: RayApp, tokens: list[int]) -> None:
    body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{app.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text


def _served_on(app: RayApp, blocks: ReplicaBlockMap, tokens: list[int]) -> int:
    """Send ``tokens`` (ending in a block of their own); the rank that cached that block."""
    _complete(app, tokens)
    return _announcer(blocks, tokens)


def _announcer(blocks: ReplicaBlockMap, tokens: list[int]) -> int:
    """The rank whose events announced the last full block of ``tokens``, waited for."""
    last = _hashes(tokens)[-1]
    deadline = time.monotonic() + TIMEOUT
    while True:
        for rank in (0, 1):
            if blocks.longest_prefix([last]) == (1, [rank]):
                return rank
        assert time.monotonic() < deadline, "no replica announced the request's last block"
        time.sleep(0.02)


def test_requests_follow_the_announced_blocks_until_they_are_evicted(
    kv_app: RayApp, watched: ReplicaBlockMap
) -> None:
    rng = random.Random(7)

    def tokens(count: int) -> list[int]:
        # Random blocks: no two prompts here share their first block.
        return [rng.randrange(3, 380) for _ in range(count)]

    def served_on(prompt: list[int]) -> int:
        return _served_on(kv_app, watched, prompt)

    # Until a prompt's repeat follows it, a subscriber (ours or the router's) may
    # not have joined yet: ZMQ drops what a PUB sends before then.
    deadline = time.monotonic() + TIMEOUT
    while True:
        warm = tokens(2 * BLOCK)
        if served_on([*warm, *tokens(BLOCK)]) == served_on(warm):
            break
        assert time.monotonic() < deadline, "the router never followed a cached prompt"

    prefix = tokens(5 * BLOCK)
    owner = served_on(prefix)
    for _ in range(4):
        assert served_on([*prefix, *tokens(BLOCK)]) == owner

    # Once no replica holds the prefix, it goes where the load rule says: idle replicas
    # take fresh prompts in turn, so right after one on the owner, the other. The prefix
    # router would send it to the owner still. The turn is the router's, not the test's:
    # should it fall on the owner, the next round evicts the prefix again.
    first_block = _hashes(prefix)[:1]
    for _ in range(3):
        for _ in range(60):  # fresh prompts fill both caches until the prefix is evicted
            if watched.longest_prefix(first_block) == (0, []):
                break
            served_on(tokens(8 * BLOCK))
        assert watched.longest_prefix(first_block) == (0, []), "the prefix was never evicted"
        for _ in range(6):
            if served_on(tokens(2 * BLOCK)) == owner:
                break
        elsewhere = served_on([*prefix, *tokens(BLOCK)])
        if elsewhere != owner:
            break
    assert elsewhere != owner, "the evicted prefix kept going to the replica that evicted it"
    # And it follows the prefix to where it is cached now.
    assert served_on([*prefix, *tokens(BLOCK)]) == elsewhere
