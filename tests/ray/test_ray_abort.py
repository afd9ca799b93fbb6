"""A client leaving aborts its request on the replica, which frees the request's blocks."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need the [ray] extra (ray[serve])")

from ray_app_fixtures import MODEL_NAME, RayApp, wait_for

# Long enough to be still running when the client leaves (hundreds of steps).
LONG = {"model": MODEL_NAME, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _sum(ray_app: RayApp, name: str, **labels: str) -> float:
    return ray_app.samples(name, **labels).get("", 0.0)


def test_client_disconnect_aborts_on_the_replica_and_frees_its_blocks(ray_app: RayApp) -> None:
    aborted_before = _sum(ray_app, "kvserve_request_success_total", finish_reason="abort")
    body = {**LONG, "prompt": "the quick brown fox", "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{ray_app.url}/v1/completions", json=body, headers=ray_app.headers
        ) as response,
    ):
        assert response.status_code == 200
        next(response.iter_lines())  # the request runs on a replica; now leave
    wait_for(
        lambda: (
            _sum(ray_app, "kvserve_request_success_total", finish_reason="abort")
            == aborted_before + 1
        ),
        15,
        "the replica to abort the request",
    )
    wait_for(
        lambda: (
            _sum(ray_app, "kvserve_num_requests_running") == 0
            and _sum(ray_app, "kvserve_kv_cache_blocks_used") == 0
        ),
        10,
        "the replica to free the request's blocks",
    )
