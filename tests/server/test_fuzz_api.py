"""A short run of the API fuzzer on the tiny model (``make fuzz`` runs 5,000 cases).

schemathesis generates requests from the server's own /openapi.json, valid and
invalid, for every route in it; every answer must pass ``fuzz.api_checks``
and schemathesis's checks against the document, and afterwards the server
must be healthy and hold no request and no KV block. Once without a key,
once with one (where requests without it must get 401).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fuzz.api_fuzz import fuzz_server
from fuzz.api_fuzz_summary import FuzzSummary
from fuzz.api_sender import ServerUnderTest, is_healthy

API_KEY = "fuzz-test-key-7d1e0c"
# Enough for every route and both generation modes, in about 15 s a server here.
NUM_CASES = 200
# Short generations, and a KV pool small enough that n > 1 over several prompts preempts.
ENGINE_ARGS = {"max_model_len": 64, "num_blocks": 256}
SCHEMA_ROUTES = {
    "GET /health",
    "GET /v1/models",
    "GET /metrics",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /tokenize",
    "POST /detokenize",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /v1/embeddings",
}
# Routes of stored responses: the fuzzer's made-up ids are never stored, so they get 404.
# The server under test serves a generator, so embeddings are refused (400 naming model).
REFUSED_ROUTES = {
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /v1/embeddings",
}


def fuzz(server: Any, setup: str, api_key: str | None) -> FuzzSummary:
    summary = FuzzSummary(seed=0)
    target = ServerUnderTest(setup, server.url, api_key, lambda: is_healthy(server.url))
    fuzz_server(target, NUM_CASES, seed=0, summary=summary)
    return summary


def routes_answered(summary: FuzzSummary, status_class: str) -> set[str]:
    return {route for (_, route, status), n in summary.requests.items() if status == status_class}


def test_the_schema_covers_every_route(start_tiny_server: Any) -> None:
    server = start_tiny_server(engine_args=ENGINE_ARGS)
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    routes = {f"{method.upper()} {path}" for path, ops in paths.items() for method in ops}
    assert routes == SCHEMA_ROUTES


@pytest.mark.parametrize("api_key", [None, API_KEY], ids=["no key", "api key"])
def test_generated_requests_get_no_5xx_and_every_error_in_openai_shape(
    start_tiny_server: Any, api_key: str | None
) -> None:
    keys = () if api_key is None else (api_key,)
    server = start_tiny_server(engine_args=ENGINE_ARGS, api_keys=keys)
    summary = fuzz(server, "api key" if api_key else "no key", api_key)

    assert summary.ok, summary.format()
    assert summary.cases >= NUM_CASES and summary.num_5xx == 0
    # Every route was reached, and the bodies got both answers: served and refused.
    served = SCHEMA_ROUTES - REFUSED_ROUTES
    assert routes_answered(summary, "2xx") >= served, summary.format()
    assert routes_answered(summary, "4xx") >= REFUSED_ROUTES, summary.format()
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= routes_answered(summary, "4xx")
    if api_key is not None:
        assert summary.requests[("api key", "GET /metrics", "4xx")] > 0  # the 401 probes
    server.wait_idle()
    assert server.async_engine.is_healthy
