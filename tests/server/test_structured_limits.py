"""Grammars beyond llguidance's limits, and tool schemas with ``$defs``, on the tiny model.

A regex whose lexer runs out of fuel (``a{1000}{1000}``), the same as a Lark
terminal, and a rule of 3,000 alternatives (a parser row holds at most 2,000
items) all build; they fail only on their first token. The server probes each
grammar's first steps when it compiles it, so such a request is a 400 naming
the field, answered before anything is queued, and the log names the grammar
by digest and length, never by its text.

A tool whose parameters have their own ``$defs`` works when a call is forced
(``required``, and named): its ``$ref``s resolve, and the calls validate
against the tool's schema (``jsonschema``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import httpx
import jsonschema
import pytest

from kvserve.benchmarks.workloads.structured_schemas import obj
from model_fixtures import TINY_CHAT_TEMPLATE

LIMITED = [
    ({"regex": "a{1000}{1000}"}, "structured_outputs.regex"),
    ({"regex": "((a{100}){100}){100}"}, "structured_outputs.regex"),
    ({"grammar": "start: /a{1000}{1000}/"}, "structured_outputs.grammar"),
    (
        {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(3000))},
        "structured_outputs.grammar",
    ),
]

POINT = obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}, "unit": {"enum": ["cm", "in"]}})
SHAPES = {
    "$defs": {"point": POINT},
    **obj(
        {
            "start": {"$ref": "#/$defs/point"},
            "more": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        }
    ),
}
DRAW = {"type": "function", "function": {"name": "draw", "parameters": SHAPES}}
# A second tool, also with a "point" in its $defs (another one): the two must not collide.
MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {
            "$defs": {"point": {"type": "integer", "minimum": 1, "maximum": 3}},
            **obj({"by": {"$ref": "#/$defs/point"}}),
        },
    },
}
SCHEMAS = {"draw": SHAPES, "move": MOVE["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    """A server only ever sent requests it refuses: not one KV block is ever used."""
    return start_tiny_server()


@pytest.fixture(scope="module")
def tools_server(start_tiny_server: Any) -> Any:
    server = start_tiny_server()
    # A template that takes the tools (and shows none of them): the Hermes-style tools
    # prompt would not fit the tiny model's context in its few hundred tokens.
    server.async_engine.engine.tokenizer.chat_template = TINY_CHAT_TEMPLATE + "{# tools #}"
    return server


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize(("spec", "field"), LIMITED)
def test_grammars_beyond_the_limits_are_a_400_before_queuing(
    server: Any, caplog: pytest.LogCaptureFixture, spec: dict[str, Any], field: str
) -> None:
    engine = server.async_engine.engine
    text = next(iter(spec.values()))
    body = {"prompt": "hello", "max_tokens": 8, "structured_outputs": spec}
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert "limits" in error["message"] and text not in error["message"]
    # Refused before queuing: nothing ever ran, nothing waits, no KV block was used.
    assert engine.has_unfinished_requests() is False
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_usable_blocks
    assert engine.peak_num_blocks_used == 0
    # The log line names the grammar by digest and length, not by its text.
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    lines = [r.getMessage() for r in caplog.records if digest in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert f"({len(text)} chars)" in lines[0]
    assert all(text not in r.getMessage() for r in caplog.records)
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)


def test_the_same_grammar_as_a_chat_response_format_names_that_field(server: Any) -> None:
    pattern = {"type": "string", "pattern": "^a{1000}{1000}$"}
    schema = {"type": "object", "properties": {"a": pattern}, "required": ["a"]}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"


# With parallel calls allowed the random model may write eight of them, past the tiny
# context: tests/unit/test_structured_schemas.py checks that wrapping at the grammar's level.
@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [("required", False), ({"type": "function", "function": {"name": "draw"}}, None)],
)
def test_a_tool_with_defs_works_under_every_forced_wrapping(
    tools_server: Any, tool_choice: Any, parallel: bool | None
) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "draw a line"}],
        "tools": [DRAW, MOVE],
        "tool_choice": tool_choice,
    }  # no max_tokens: the rest of the context (the tools prompt is long in tiny tokens)
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        response = post(tools_server, "/v1/chat/completions", {**body, **sampling})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls and (parallel is not False or len(calls) == 1)
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        if isinstance(tool_choice, dict):
            assert [call["function"]["name"] for call in calls] == ["draw"]
