"""The server's OpenAPI document (``GET /openapi.json``): request bodies, responses, the key.

The endpoints read their bodies themselves (``ServingBase.parse_body``: the
size limit comes before parsing, and pydantic's errors become OpenAI's), so
FastAPI sees a bare ``Request`` and would document no body and only a 200
of unknown shape. :func:`install_openapi` completes the document from the
protocol models: each POST's JSON body, each route's responses with their
status codes (every error in the ``ErrorResponse`` shape), and, when the
server has keys, the Bearer scheme every route but /health needs. Clients
generated from the document, and the API fuzzer (``tests/fuzz/api_fuzz.py``),
then see the API the server really implements.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from kvserve.entrypoints.openai.auth import OPEN_PATHS
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.entrypoints.openai.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from kvserve.entrypoints.openai.protocol_responses import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)

_REF = "#/components/schemas/{model}"
_SCHEME = "apiKey"
# Every error status the server itself answers, and when.
_ERRORS = {
    400: "Malformed JSON, a wrong type, a value out of range, an unknown field or model",
    408: "The body did not arrive within --timeout-body (plus 1 s per --min-body-rate bytes)",
    413: "The body exceeds --max-request-body-bytes",
    415: "The body is not sent as 'Content-Type: application/json'",
    500: "The engine failed while computing the request (only an error id is given)",
    503: "Too many sequences waiting or too many open connections (both with Retry-After), "
    "or the engine is not running",
}
# Any route but /health, past the connection limits (connection_limits.py).
_TOO_MANY_CONNECTIONS = (
    "Too many open connections: past --limit-concurrency, or past "
    "--limit-concurrency-per-peer from the client's address (with Retry-After)"
)
_UNAUTHORIZED = "A missing or wrong 'Authorization: Bearer <key>'"
_MODELS: list[tuple[type[BaseModel], JsonSchemaMode]] = [
    (CompletionRequest, "validation"),
    (ChatCompletionRequest, "validation"),
    (CompletionResponse, "serialization"),
    (ChatCompletionResponse, "serialization"),
    (ChatCompletionChunk, "serialization"),
    (ModelList, "serialization"),
    (TokenizeRequest, "validation"),
    (TokenizeResponse, "serialization"),
    (DetokenizeRequest, "validation"),
    (DetokenizeResponse, "serialization"),
    (ResponsesRequest, "validation"),
    (ResponseObject, "serialization"),
    (ResponseStreamEvent, "serialization"),
    (ResponseDeleted, "serialization"),
    (ErrorResponse, "serialization"),
]
# Each POST's body, its response, and the chunks of its stream.
_POSTS: dict[str, tuple[type[BaseModel], type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (CompletionRequest, CompletionResponse, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    "/v1/responses": (ResponsesRequest, ResponseObject, ResponseStreamEvent),
}
_STORED_RESPONSE = "/v1/responses/{response_id}"
_NOT_FOUND = "No stored response with this id for this API key (also previous_response_id's)"
# POSTs without a stream: their body and response.
_PLAIN_POSTS: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/embeddings": (EmbeddingRequest, EmbeddingResponse),
    "/tokenize": (TokenizeRequest, TokenizeResponse),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse),
}


def install_openapi(app: FastAPI, *, has_api_keys: bool) -> None:
    """Make ``app.openapi()`` (served at /openapi.json) describe the API completely."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = _complete(document, has_api_keys)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _complete(document: dict[str, Any], has_api_keys: bool) -> dict[str, Any]:
    _, definitions = models_json_schema(_MODELS, ref_template=_REF)
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(definitions["$defs"])
    if has_api_keys:
        components["securitySchemes"] = {_SCHEME: {"type": "http", "scheme": "bearer"}}
        document["security"] = [{_SCHEME: []}]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            protected = has_api_keys and path not in OPEN_PATHS
            operation["responses"] = _responses(path, method, protected)
            if has_api_keys and not protected:
                operation["security"] = []  # open to anyone: overrides the document's
            if method == "post" and (path in _POSTS or path in _PLAIN_POSTS):
                body = _POSTS[path][0] if path in _POSTS else _PLAIN_POSTS[path][0]
                operation["requestBody"] = {"required": True, "content": _json(body)}
    return document


def _responses(path: str, method: str, protected: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    if method == "post" and path in _POSTS:
        _, response, chunk = _POSTS[path]
        responses["200"] = _ok(
            "The completion; with stream=true, Server-Sent Events ending with data: [DONE] "
            "(/v1/responses: ending with its response.completed or response.incomplete event)",
            {
                "application/json": {"schema": _ref(response)},
                "text/event-stream": {"schema": _event(chunk)},
            },
        )
        responses.update({str(status): _error(why) for status, why in _ERRORS.items()})
        if path == "/v1/responses":
            responses["404"] = _error(_NOT_FOUND)
    elif path == _STORED_RESPONSE:
        response = ResponseObject if method == "get" else ResponseDeleted
        responses["200"] = _ok(
            "The stored response" if method == "get" else "Deleted", _json(response)
        )
        responses["400"] = _error("A query parameter (none is supported)")
        responses["404"] = _error(_NOT_FOUND)
    elif method == "post" and path in _PLAIN_POSTS:
        responses["200"] = _ok("The result", _json(_PLAIN_POSTS[path][1]))
        responses.update({str(status): _error(_ERRORS[status]) for status in (400, 408, 413, 415)})
    elif path == "/v1/models":
        responses["200"] = _ok("The served model", _json(ModelList))
    elif path == "/metrics":
        text = {"text/plain": {"schema": {"type": "string"}}}
        responses["200"] = _ok("Prometheus text format", text)
    elif path == "/health":
        status = {"type": "object", "properties": {"status": {"const": "ok"}}}
        responses["200"] = _ok("The engine loop runs", {"application/json": {"schema": status}})
        responses["503"] = _error("The engine is not running")
    if path != "/health":
        responses.setdefault("503", _error(_TOO_MANY_CONNECTIONS))
    if protected:
        responses["401"] = _error(_UNAUTHORIZED)
    return responses


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One Server-Sent Event of a stream (OpenAPI 3.1: a stream's ``schema`` is per event).

    Its data is a chunk, an error (a failure after the 200 went out), or the final ``[DONE]``.
    """
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _ok(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": content}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json(ErrorResponse)}
