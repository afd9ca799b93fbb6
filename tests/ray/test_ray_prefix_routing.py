"""Prefix-aware routing: a shared prefix stays on one replica, distinct prompts spread.

Read from the replicas' own counters (``/metrics`` with a ``replica`` label):
prompt tokens say where a request ran, prefix-cache hits that it found its
prefix there.
"""

from __future__ import annotations

import random

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")

from ray_app_fixtures import MODEL_NAME, RayApp, wait_for

BLOCK_SIZE = 4
NUM_REQUESTS = 6


def _per_replica(ray_app: RayApp, name: str) -> dict[str, float]:
    return {r: v for r, v in ray_app.samples(name).items() if r}


def _complete(ray_app: RayApp, token_ids: list[int]) -> None:
    body = {"model": MODEL_NAME, "prompt": token_ids, "max_tokens": 2, "temperature": 0}
    response = httpx.post(
        f"{ray_app.url}/v1/completions", json=body, headers=ray_app.headers, timeout=30
    )
    assert response.status_code == 200, response.text


def _run(ray_app: RayApp, prompts: list[list[int]]) -> tuple[dict[str, float], dict[str, float]]:
    """Send ``prompts`` one after another; the growth of each replica's prompt tokens and hits."""
    tokens_before = _per_replica(ray_app, "kvserve_prompt_tokens_total")
    hits_before = _per_replica(ray_app, "kvserve_prefix_cache_hits_total")
    for prompt in prompts:
        _complete(ray_app, prompt)
    expected = sum(tokens_before.values()) + sum(len(p) for p in prompts)
    wait_for(
        lambda: ray_app.samples("kvserve_prompt_tokens_total")[""] >= expected,
        10,
        "the replicas to publish their metrics",
    )
    tokens = _per_replica(ray_app, "kvserve_prompt_tokens_total")
    hits = _per_replica(ray_app, "kvserve_prefix_cache_hits_total")
    return (
        {r: tokens[r] - tokens_before.get(r, 0) for r in tokens},
        {r: hits[r] - hits_before.get(r, 0) for r in hits},
    )


def test_shared_prefix_lands_on_one_replica(ray_app: RayApp) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 90) for _ in range(4 * BLOCK_SIZE)]
    prompts = [prefix + [rng.randrange(3, 90) for _ in range(BLOCK_SIZE)] for _ in range(6)]
    tokens, hits = _run(ray_app, prompts)
    busy = [replica for replica, grown in tokens.items() if grown > 0]
    assert len(busy) == 1, tokens
    # Every request after the first found the whole prefix in that replica's cache.
    assert hits[busy[0]] >= (NUM_REQUESTS - 1) * len(prefix)
    assert sum(hits.values()) == hits[busy[0]]


def test_distinct_prompts_spread_over_both_replicas(ray_app: RayApp) -> None:
    rng = random.Random(1)
    prompts = [[90 + i] + [rng.randrange(3, 90) for _ in range(11)] for i in range(8)]
    tokens, hits = _run(ray_app, prompts)
    assert len(tokens) == 2
    assert all(grown >= 2 * 12 for grown in tokens.values()), tokens
    assert sum(hits.values()) == 0
