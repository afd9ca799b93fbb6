"""A server with speculative decoding exports its counters on /metrics, equal to the engine's."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

# Every decoding request proposes (not adaptive): what the tests count never depends
# on how long steps took.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    return start_tiny_server(engine_args={"speculative_config": SPEC})


def test_speculation_counters_reach_metrics(server: Any) -> None:
    # A prompt that repeats itself gives the n-gram lookup something to propose.
    body = {
        "model": "tiny",
        "prompt": "abc abc abc abc abc abc abc abc",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    server.wait_idle()
    stats = server.async_engine.engine.stats
    assert stats.num_spec_proposed_tokens > 0
    want = (stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens)
    # The loop thread records the last step's metrics just after the step; give it a moment.
    deadline = time.monotonic() + 10
    while True:
        proposed = server.metric("kvserve_spec_proposed_tokens_total")
        accepted = server.metric("kvserve_spec_accepted_tokens_total")
        if (proposed, accepted) == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (proposed, accepted) == want
    assert server.metric("kvserve_spec_acceptance_rate") == pytest.approx(accepted / proposed)
