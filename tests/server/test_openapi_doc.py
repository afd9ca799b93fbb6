"""/openapi.json describes the API the server implements: bodies, responses, the key."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

API_KEY = "openapi-doc-key"


@pytest.fixture(scope="module")
def documents(start_tiny_server: Any) -> dict[str, dict[str, Any]]:
    open_server = start_tiny_server()
    key_server = start_tiny_server(api_keys=(API_KEY,))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return {
        "open": httpx.get(f"{open_server.url}/openapi.json").json(),
        "keyed": httpx.get(f"{key_server.url}/openapi.json", headers=headers).json(),
    }


def test_each_post_documents_its_json_body_and_its_answers(
    documents: dict[str, dict[str, Any]],
) -> None:
    document = documents["open"]
    schemas = document["components"]["schemas"]
    for path, body, chunk in [
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionChunk"),
    ]:
        operation = document["paths"][path]["post"]
        body_schema = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body_schema == {"$ref": f"#/components/schemas/{body}"}
        assert operation["requestBody"]["required"] is True
        assert set(operation["responses"]) == {"200", "400", "408", "413", "415", "500", "503"}
        event = operation["responses"]["200"]["content"]["text/event-stream"]["schema"]
        data = event["properties"]["data"]["anyOf"]
        assert data[0] == {"const": "[DONE]"}
        assert {"$ref": f"#/components/schemas/{chunk}"} in data[1]["contentSchema"]["anyOf"]
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    # The strict parser refuses unknown fields; the document says so.
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    assert "securitySchemes" not in document["components"] and "security" not in document


def test_with_a_key_every_route_but_health_documents_bearer_and_401(
    documents: dict[str, dict[str, Any]],
) -> None:
    document = documents["keyed"]
    assert document["components"]["securitySchemes"] == {
        "apiKey": {"type": "http", "scheme": "bearer"}
    }
    assert document["security"] == [{"apiKey": []}]
    for path, operations in document["paths"].items():
        for operation in operations.values():
            if path == "/health":
                assert operation["security"] == [] and "401" not in operation["responses"]
            else:
                assert "security" not in operation and "401" in operation["responses"]


def test_every_route_documents_the_connection_limits_503_and_posts_the_415(
    documents: dict[str, dict[str, Any]],
) -> None:
    for path, operations in documents["open"]["paths"].items():
        for method, operation in operations.items():
            assert "503" in operation["responses"], path  # /health's: the engine is down
            if method == "post":
                assert {"408", "415"} <= set(operation["responses"]), path


def test_the_responses_routes_document_their_bodies_and_404(
    documents: dict[str, dict[str, Any]],
) -> None:
    paths = documents["open"]["paths"]
    create = paths["/v1/responses"]["post"]
    body = create["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert {"200", "400", "404", "415"} <= set(create["responses"])
    stored = paths["/v1/responses/{response_id}"]
    for method, model in (("get", "ResponseObject"), ("delete", "ResponseDeleted")):
        answers = stored[method]["responses"]
        schema = answers["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}
        assert "404" in answers
