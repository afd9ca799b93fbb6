"""Malformed and hostile requests: each gets its documented 4xx and an OpenAI error body.

None reaches the engine (nothing is queued, no token is computed), none gets
a 5xx, and the server answers a valid request afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BODY_LIMIT = 64 * 1024


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "The quick brown fox", "max_tokens": 4, **fields}


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _nested(depth: int) -> dict[str, Any]:
    """A JSON schema ``depth`` objects deep (array items of array items of ...)."""
    schema: dict[str, Any] = {}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **fields}


def chunked_body() -> Iterator[bytes]:
    """A body without Content-Length, bigger than the limit."""
    yield b'{"prompt": "'
    for _ in range(BODY_LIMIT // 1024 + 2):
        yield b"a" * 1024
    yield b'"}'


# (case, path, body: a dict sent as JSON, or raw bytes/iterator, status, param)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("truncated JSON", COMPLETIONS, b'{"prompt": "hi"', 400, None),
    ("non-UTF-8 bytes", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    ("lone surrogate escape", COMPLETIONS, b'{"prompt": "\\ud800"}', 400, None),
    ("body is an array", COMPLETIONS, b"[1, 2]", 400, None),
    ("empty body", COMPLETIONS, b"", 400, None),
    ("body over the size limit", COMPLETIONS, completion(prompt="a" * BODY_LIMIT), 413, None),
    ("chunked body over the limit", COMPLETIONS, "chunked", 413, None),
    ("deeply nested JSON", COMPLETIONS, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("5000-digit integer", COMPLETIONS, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("missing prompt", COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    ("prompt is a number", COMPLETIONS, completion(prompt=42), 400, "prompt"),
    ("prompt is empty text", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("prompt is an empty list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("mixed prompt list", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt"),
    ("token id beyond the vocabulary", COMPLETIONS, completion(prompt=[1, 10**6]), 400, "prompt"),
    ("negative token id", COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    ("more prompts than allowed", COMPLETIONS, completion(prompt=["a"] * 5), 400, "prompt"),
    ("prompt longer than the context", COMPLETIONS, completion(prompt=[5] * 300), 400, "prompt"),
    ("prompt + max_tokens beyond the context", COMPLETIONS, completion(prompt=[5] * 200, max_tokens=100), 400, "max_tokens"),
    ("max_tokens negative", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens zero", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens huge", COMPLETIONS, completion(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens as a string", COMPLETIONS, completion(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens as a float", COMPLETIONS, completion(max_tokens=4.5), 400, "max_tokens"),
    ("temperature NaN", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("temperature infinite", COMPLETIONS, b'{"prompt": "a", "temperature": 1e999}', 400, "temperature"),
    ("temperature negative", COMPLETIONS, completion(temperature=-0.5), 400, "temperature"),
    ("temperature as a string", COMPLETIONS, completion(temperature="hot"), 400, "temperature"),
    ("top_p zero", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("top_p above one", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    ("top_k below -1", COMPLETIONS, completion(top_k=-5), 400, "top_k"),
    ("min_p above one", COMPLETIONS, completion(min_p=2), 400, "min_p"),
    ("n zero", COMPLETIONS, completion(n=0), 400, "n"),
    ("n above the cap", COMPLETIONS, completion(n=5), 400, "n"),
    ("n as a boolean", COMPLETIONS, completion(n=True), 400, "n"),
    ("seventeen stop strings", COMPLETIONS, completion(stop=["x"] * 17), 400, "stop"),
    ("stop string too long", COMPLETIONS, completion(stop="x" * 300), 400, "stop"),
    ("empty stop string", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    ("stop of the wrong type", COMPLETIONS, completion(stop=5), 400, "stop"),
    ("stop token id beyond the vocabulary", COMPLETIONS, completion(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("more stop token ids than allowed", COMPLETIONS, completion(stop_token_ids=[5] * 9), 400, "stop_token_ids"),
    ("chat with more stop token ids than allowed", CHAT, chat(stop_token_ids=[5] * 9), 400, "stop_token_ids"),
    ("more sequences than may ever wait", COMPLETIONS, completion(prompt=["a"] * 3, n=4), 400, "n"),
    ("logprobs above the cap", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    ("negative seed", COMPLETIONS, completion(seed=-1), 400, "seed"),
    ("presence_penalty out of range", COMPLETIONS, completion(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty out of range", COMPLETIONS, completion(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("repetition_penalty zero", COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_tokens above max_tokens", COMPLETIONS, completion(min_tokens=10), 400, "min_tokens"),
    ("unknown model", COMPLETIONS, completion(model="gpt-4"), 400, "model"),
    ("unknown field", COMPLETIONS, completion(max_token=4), 400, "max_token"),
    ("prompt_logprobs out of range", COMPLETIONS, completion(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("logit_bias", COMPLETIONS, completion(logit_bias={"50": 1}), 400, "logit_bias"),
    ("suffix", COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    ("stream as a string", COMPLETIONS, completion(stream="yes"), 400, "stream"),
    ("stream_options without stream", COMPLETIONS, completion(stream_options={"include_usage": True}), 400, "stream_options"),
    ("chat without messages", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("chat with empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("chat with more messages than allowed", CHAT, chat(messages=[{"role": "user", "content": "x"}] * 5), 400, "messages"),
    ("chat messages as a string", CHAT, chat(messages="hi"), 400, "messages"),
    ("chat message with an unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("chat content of the wrong type", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("chat message without content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("chat image content", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages[0].content"),
    ("chat template refuses the order", CHAT, chat(messages=[{"role": "assistant", "content": "hi"}]), 400, "messages"),
    ("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat top_logprobs above the cap", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("chat max_completion_tokens huge", CHAT, chat(max_completion_tokens=10**9), 400, "max_completion_tokens"),
    ("chat tool without its function", CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    ("chat tool with a bad name", CHAT, chat(tools=[_tool("no spaces allowed")]), 400, "tools[0].function.name"),
    ("chat tool_choice without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("chat tool_choice naming no tool", CHAT, chat(tools=[_tool("f")], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice.function.name"),
    ("chat tools with the same name", CHAT, chat(tools=[_tool("f"), _tool("f")]), 400, "tools"),
    ("chat forced call of a schema that does not compile", CHAT, chat(tools=[_tool("f", {"type": "strange"})], tool_choice="required"), 400, "tools"),
    ("chat forced call of a schema too deep", CHAT, chat(tools=[_tool("f", _nested(40))], tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tools"),
    ("chat forced call with a response format", CHAT, chat(tools=[_tool("f")], tool_choice="required", response_format={"type": "json_object"}), 400, "tool_choice"),
    ("chat tool call arguments nested 5,000 deep", CHAT, chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]), 400, "messages[1].tool_calls"),
    ("tokenize tool call arguments nested 5,000 deep", "/tokenize", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a":' * 5000 + "1" + "}" * 5000}}]}]}, 400, "messages[1].tool_calls"),
    ("chat tool call arguments not JSON", CHAT, chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]), 400, "messages[1].tool_calls"),
    ("chat response format of an unknown type", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("chat json_schema without its schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format.json_schema.schema"),
    ("chat json_schema that does not compile", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}), 400, "response_format.json_schema.schema"),
    ("chat json_schema with a dangling $ref", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}), 400, "response_format.json_schema.schema"),
    ("chat json_schema too deep", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(40)}}), 400, "response_format.json_schema.schema"),
    ("chat response_format and structured_outputs", CHAT, chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), 400, "structured_outputs"),
    ("completion regex that does not compile", COMPLETIONS, completion(structured_outputs={"regex": "[0-9"}), 400, "structured_outputs.regex"),
    ("completion regex with a lookbehind", COMPLETIONS, completion(structured_outputs={"regex": "(?<=a)b"}), 400, "structured_outputs.regex"),
    ("completion empty choice list", COMPLETIONS, completion(structured_outputs={"choice": []}), 400, "structured_outputs.choice"),
    ("completion too many choices", COMPLETIONS, completion(structured_outputs={"choice": ["x"] * 257}), 400, "structured_outputs.choice"),
    ("completion grammar that does not parse", COMPLETIONS, completion(structured_outputs={"grammar": "root ::= ( unclosed"}), 400, "structured_outputs.grammar"),
    ("completion grammar too large", COMPLETIONS, completion(structured_outputs={"grammar": "x" * 40000}), 400, "structured_outputs.grammar"),
    ("completion two constraints at once", COMPLETIONS, completion(structured_outputs={"regex": "a", "choice": ["a"]}), 400, "structured_outputs"),
    ("completion unknown constraint", COMPLETIONS, completion(structured_outputs={"whitespace_pattern": " "}), 400, "structured_outputs.whitespace_pattern"),
    ("completion schema as JSON text nested 5,000 deep", COMPLETIONS, completion(structured_outputs={"json": '{"a":' * 5000 + "1" + "}" * 5000}), 400, "structured_outputs.json"),
    ("completion schema as invalid JSON text", COMPLETIONS, completion(structured_outputs={"json": "{nope"}), 400, "structured_outputs.json"),
    ("GET on a POST route", COMPLETIONS, "GET", 405, None),
    ("unknown path", "/v1/engines", completion(), 404, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    return start_tiny_server(
        max_request_body_bytes=BODY_LIMIT,
        max_n=4,
        max_prompts_per_request=4,
        max_stop_token_ids=8,
        max_chat_messages=4,
        max_waiting_requests=8,
    )


def send(url: str, body: Any) -> httpx.Response:
    if body == "GET":
        return httpx.get(url)
    if body == "chunked":
        return httpx.post(url, content=chunked_body(), headers={"Content-Type": "application/json"})
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    return httpx.post(url, json=body)


def test_the_table_is_long_enough() -> None:
    assert len(CASES) >= 25
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_hostile_request_gets_a_4xx_with_an_openai_error_body(
    server: Any, case: str, path: str, body: Any, status: int, param: str | None
) -> None:
    response = send(server.url + path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_after_every_hostile_request_nothing_was_queued_and_a_valid_one_works(
    server: Any,
) -> None:
    for _, path, body, _, _ in CASES:
        assert send(server.url + path, body).status_code < 500
    assert server.metric("kvserve_prompt_tokens_total") == 0  # no request reached the engine
    response = httpx.post(server.url + COMPLETIONS, json=completion(temperature=0))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


def test_openai_fields_kvserve_ignores_are_accepted(server: Any) -> None:
    # Unknown fields are refused (see the table); `user` is OpenAI's and harmless.
    body = completion(user="someone", best_of=1, logit_bias={}, suffix="", model="tiny")
    response = httpx.post(server.url + COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny"
    body = completion(prompt="hi")
    del body["max_tokens"]  # an omitted model and max_tokens take the defaults
    content = json.dumps(body)
    assert httpx.post(server.url + COMPLETIONS, content=content, headers=JSON).status_code == 200


JSON = {"Content-Type": "application/json"}
BODIES = {
    COMPLETIONS: completion(),
    CHAT: chat(),
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}
# What a web page can send anywhere without a CORS preflight, and other non-JSON types.
NOT_JSON = [
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/jsonp",
    "",  # a fetch() of a Blob without a type sends no Content-Type at all
]


@pytest.mark.parametrize("path", list(BODIES))
def test_a_body_not_sent_as_json_gets_415_and_reaches_nothing(server: Any, path: str) -> None:
    # A keyless server on 127.0.0.1 answered text/plain with 200: any page in a local
    # browser could make it generate, no preflight asked.
    tokens_before = server.metric("kvserve_prompt_tokens_total")
    for content_type in NOT_JSON:
        headers = {"Content-Type": content_type} if content_type else {}
        content = json.dumps(BODIES[path])
        response = httpx.post(server.url + path, content=content, headers=headers)
        assert response.status_code == 415, (content_type, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_media_type")
    assert server.metric("kvserve_prompt_tokens_total") == tokens_before


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_a_json_body_is_accepted_with_any_parameters(
    server: Any, path: str, content_type: str
) -> None:
    content = json.dumps(BODIES[path])
    response = httpx.post(
        server.url + path, content=content, headers={"Content-Type": content_type}
    )
    assert response.status_code == 200, response.text


def test_fastapi_validation_errors_become_openai_400s() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvserve.entrypoints.openai.api_errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/items")
    async def items(limit: int) -> dict[str, int]:
        return {"limit": limit}

    response = TestClient(app).get("/items", params={"limit": "many"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "limit"
