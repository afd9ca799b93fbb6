"""The live dashboard's JSON carries the speculation and disk-tier figures /metrics exports."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

# Every decoding request proposes (not adaptive): what is counted never depends on timing.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def server(start_tiny_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder: Path = tmp_path_factory.mktemp("prefix-cache")
    return start_tiny_server(
        engine_args={"speculative_config": SPEC, "prefix_cache_dir": str(folder)}
    )


def test_the_latest_frame_agrees_with_metrics(server: Any) -> None:
    # A prompt that repeats itself gives the n-gram lookup something to propose; sent
    # twice, the second finds the first's blocks in the pool.
    body = {
        "model": "tiny",
        "prompt": "abc abc abc abc abc abc abc abc",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    for _ in range(2):
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
    server.wait_idle()
    # The loop thread publishes the idle frame and records the metrics just after the
    # last step; give it a moment.
    deadline = time.monotonic() + 10
    while True:
        frame = httpx.get(f"{server.url}/dashboard/state").json()
        spec, disk = frame["spec"], frame["disk"]
        want = {
            "proposed": server.metric("kvserve_spec_proposed_tokens_total"),
            "accepted": server.metric("kvserve_spec_accepted_tokens_total"),
            "writes": server.metric("kvserve_prefix_cache_disk_writes_total"),
            "pool_hit_tokens": server.metric("kvserve_prefix_cache_hits_total"),
        }
        got = {
            "proposed": spec["proposed"],
            "accepted": spec["accepted"],
            "writes": disk["writes"],
            "pool_hit_tokens": disk["pool_hit_tokens"],
        }
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == want
    assert spec["proposed"] > 0 and disk["pool_hit_tokens"] > 0 and disk["writes"] > 0
    assert spec["acceptance"] == pytest.approx(
        server.metric("kvserve_spec_acceptance_rate"), abs=1e-4
    )
    assert spec["adaptive"] is False and spec["declined"] == 0
    assert disk["enabled"] and disk["disk_hits"] == disk["loads"] == 0
