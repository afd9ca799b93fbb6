"""The stored responses of /v1/responses: bounded, least recently used forgotten, per API key."""

from __future__ import annotations

import pytest

from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol import ChatMessage
from kvserve.entrypoints.openai.protocol_responses import ResponseObject
from kvserve.entrypoints.openai.response_store import ResponseStore, StoredResponse


def stored(response_id: str) -> StoredResponse:
    response = ResponseObject(
        id=response_id,
        created_at=0,
        status="completed",
        instructions=None,
        max_output_tokens=None,
        metadata={},
        model="m",
        output=[],
        parallel_tool_calls=True,
        previous_response_id=None,
        store=True,
        temperature=None,
        top_p=None,
        text={"format": {"type": "text"}},
        tool_choice="auto",
        tools=[],
    )
    return StoredResponse(response, [ChatMessage(role="user", content=response_id)])


def assert_missing(store: ResponseStore, tenant: str | None, response_id: str) -> None:
    with pytest.raises(ApiError) as raised:
        store.get(tenant, response_id)
    assert raised.value.status_code == 404 and raised.value.code == "not_found"


def test_past_capacity_the_least_recently_used_is_forgotten() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", stored("r1"))
    store.put("a", stored("r2"))
    assert store.get("a", "r1").response.id == "r1"  # r1 is now the most recently used
    store.put("a", stored("r3"))
    assert len(store) == 2
    assert_missing(store, "a", "r2")
    assert store.get("a", "r1").conversation[0].content == "r1"
    assert store.get("a", "r3").response.id == "r3"


def test_a_key_never_sees_or_deletes_another_keys_responses() -> None:
    store = ResponseStore()
    store.put("a", stored("r1"))
    assert_missing(store, "b", "r1")
    assert_missing(store, None, "r1")  # nor does a request without a key
    with pytest.raises(ApiError):
        store.delete("b", "r1")
    assert store.get("a", "r1").response.id == "r1"
    store.delete("a", "r1")
    assert_missing(store, "a", "r1")
    with pytest.raises(ApiError) as raised:
        store.get("a", "r1", param="previous_response_id")
    assert raised.value.param == "previous_response_id"


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(capacity=0)
