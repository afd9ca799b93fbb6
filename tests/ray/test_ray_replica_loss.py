"""Losing a replica: its in-flight requests fail, the others run to their end, and the
app goes on serving. Runs last in tests/ray (by name): the killed replica restarts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")

import ray
from ray_app_fixtures import MODEL_NAME, RayApp

# Long enough to be still running when the replica is killed (hundreds of steps).
LONG = {"model": MODEL_NAME, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


async def _stream(
    client: httpx.AsyncClient, ray_app: RayApp, prompt: str, started: asyncio.Event
) -> str:
    """``ok`` when the stream ran to its end, ``failed`` when it ended with an error event."""
    body = {**LONG, "prompt": prompt, "stream": True}
    async with client.stream(
        "POST", f"{ray_app.url}/v1/completions", json=body, headers=ray_app.headers
    ) as response:
        assert response.status_code == 200
        finish_reason = None
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return "failed"
            finish_reason = event["choices"][0]["finish_reason"] or finish_reason
            started.set()
    return "ok" if finish_reason == "length" else f"ended with {finish_reason}"


async def _load_then_kill(ray_app: RayApp) -> dict[str, list[str]]:
    # Two groups of requests, each sharing a prefix: prefix-aware routing puts each
    # group on one replica, the second group on the less loaded one.
    groups = {
        name: [f"{words} {suffix}" for suffix in ("one", "two", "three")]
        for name, words in (
            ("a", "the lazy dog sleeps in the sun while the cat"),
            ("b", "a quick brown fox jumps over every fence and"),
        )
    }
    async with httpx.AsyncClient(timeout=60) as client:
        tasks: dict[str, list[asyncio.Task[str]]] = {name: [] for name in groups}
        started: list[asyncio.Event] = []

        def send(name: str, index: int) -> None:
            started.append(asyncio.Event())
            stream = _stream(client, ray_app, groups[name][index], started[-1])
            tasks[name].append(asyncio.create_task(stream))

        async def all_started() -> None:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)

        # A group's first request streams (the router has recorded its replica) before the
        # rest of the group follows it; the second group's first finds that replica busier.
        # Waiting on tokens, not on a pause, also kills the replica as early as it can be:
        # the first request has run only a few first-token latencies of its 400 steps.
        send("a", 0)
        await all_started()
        for name, index in (("a", 1), ("a", 2), ("b", 0)):
            send(name, index)
        await all_started()
        for index in (1, 2):
            send("b", index)
        await all_started()
        victim = ray_app.engine_replica_names()[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
        return {name: list(await asyncio.gather(*group)) for name, group in tasks.items()}


def test_killing_a_replica_fails_only_its_requests(ray_app: RayApp) -> None:
    outcomes = asyncio.run(asyncio.wait_for(_load_then_kill(ray_app), 120))
    # One group ran on the killed replica and failed whole; the other ran to its end.
    assert sorted(outcomes.values()) == [["failed"] * 3, ["ok"] * 3], outcomes
    for attempt in range(4):
        body = {"model": MODEL_NAME, "prompt": f"after the loss {attempt}", "max_tokens": 4}
        response = httpx.post(
            f"{ray_app.url}/v1/completions", json=body, headers=ray_app.headers, timeout=60
        )
        assert response.status_code == 200, response.text
