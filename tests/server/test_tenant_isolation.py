"""Prefix-cache isolation: requests share cached blocks only under the same salt.

A prefix-cache hit makes the first token come sooner, so a client that can hit
another's blocks can tell what that client sent. ``cache_salt`` separates
requests, and ``salt_cache_by_api_key`` gives every API key a salt of its own.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

KEY_A = "tenant-a-key"
KEY_B = "tenant-b-key"
# Long enough to fill several 4-token blocks, so a hit has blocks to reuse.
PROMPT = "Paged attention stores keys and values in fixed-size blocks of memory."


@pytest.fixture(scope="module")
def salted_server(start_tiny_server: Any) -> Any:
    return start_tiny_server(api_keys=(KEY_A, KEY_B), salt_cache_by_api_key=True)


@pytest.fixture(scope="module")
def shared_server(start_tiny_server: Any) -> Any:
    return start_tiny_server(api_keys=(KEY_A, KEY_B))


def prefix_hits(server: Any, key: str, path: str = "/v1/completions", **fields: Any) -> int:
    """Prompt tokens the request found in the prefix cache."""
    before = server.async_engine.engine.stats.prefix_cache_hits
    body = {"max_tokens": 2, **fields}
    if path == "/v1/completions":
        body.setdefault("prompt", PROMPT)
    else:
        body.setdefault("messages", [{"role": "user", "content": PROMPT}])
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(server.url + path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    server.wait_idle()
    return int(server.async_engine.engine.stats.prefix_cache_hits - before)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_key_has_its_own_prefix_cache(salted_server: Any, path: str) -> None:
    prompt = f"{path}: {PROMPT}"
    fields: dict[str, Any] = (
        {"prompt": prompt}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": prompt}]}
    )
    assert prefix_hits(salted_server, KEY_A, path, **fields) == 0
    assert prefix_hits(salted_server, KEY_B, path, **fields) == 0  # same prompt, other key
    assert prefix_hits(salted_server, KEY_A, path, **fields) > 0  # same key: a hit
    assert prefix_hits(salted_server, KEY_B, path, **fields) > 0


def test_a_cache_salt_separates_requests_of_one_key(salted_server: Any) -> None:
    prompt = f"salted: {PROMPT}"
    assert prefix_hits(salted_server, KEY_A, prompt=prompt) == 0
    assert prefix_hits(salted_server, KEY_A, prompt=prompt, cache_salt="one") == 0
    assert prefix_hits(salted_server, KEY_A, prompt=prompt, cache_salt="two") == 0
    assert prefix_hits(salted_server, KEY_A, prompt=prompt, cache_salt="one") > 0
    # Another key with the same cache_salt still gets a salt of its own.
    assert prefix_hits(salted_server, KEY_B, prompt=prompt, cache_salt="one") == 0


def test_without_salting_by_key_only_the_cache_salt_separates(shared_server: Any) -> None:
    prompt = f"shared: {PROMPT}"
    assert prefix_hits(shared_server, KEY_A, prompt=prompt) == 0
    assert prefix_hits(shared_server, KEY_B, prompt=prompt) > 0  # keys share the cache
    assert prefix_hits(shared_server, KEY_B, prompt=prompt, cache_salt="mine") == 0
    assert prefix_hits(shared_server, KEY_A, prompt=prompt, cache_salt="mine") > 0


@pytest.mark.parametrize(
    ("cache_salt", "expected"),
    [("", "at least 1 character"), ("x" * 257, "at most 256 characters"), (7, "string")],
)
def test_a_bad_cache_salt_gets_a_400_naming_it(
    shared_server: Any, cache_salt: Any, expected: str
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "cache_salt": cache_salt}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    response = httpx.post(f"{shared_server.url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "cache_salt" and expected in error["message"]


def test_each_keys_blocks_on_disk_are_its_own_after_a_restart(
    start_tiny_server: Any, tmp_path: Any
) -> None:
    engine_args = {"prefix_cache_dir": str(tmp_path)}
    prompt = f"on disk: {PROMPT}"
    first = start_tiny_server(engine_args, api_keys=(KEY_A, KEY_B), salt_cache_by_api_key=True)
    assert prefix_hits(first, KEY_A, prompt=prompt) == 0
    first.async_engine.engine.disk_tier.flush()
    # A second server on the same folder: a fresh pool, the same salts for the same keys.
    second = start_tiny_server(engine_args, api_keys=(KEY_A, KEY_B), salt_cache_by_api_key=True)
    assert prefix_hits(second, KEY_B, prompt=prompt) == 0
    assert prefix_hits(second, KEY_A, prompt=prompt) > 0
    snapshot = second.async_engine.engine.stats.disk_tier
    assert snapshot is not None and snapshot.counters.loads > 0
