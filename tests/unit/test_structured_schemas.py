"""Strict JSON schemas and tool schemas with ``$defs``, at the grammar's level.

No model: token sequences (the tiny byte-level tokenizer's encoding of JSON
text) go straight into the compiled grammar's matcher, so what is accepted
or refused is the grammar's doing alone. The constraints come from the
server's own request handling (``structured_outputs`` for a
``response_format``, ``forced_call_constraint`` for tools), so they are what
a request gets.

Strict (OpenAI's meaning): the twenty everyday schemas, written with their
objects open as clients often write them, accept every instance generated
from them with all properties present (compact, keys sorted by name, as the
grammar writes JSON), each checked against the schema by ``jsonschema``;
they refuse a key beyond the listed ones, a missing property and whitespace
between tokens. Without ``strict`` the spec is the one it always was.
"""

from __future__ import annotations

import copy
import itertools
import json
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from kvserve.benchmarks.workloads.structured_schemas import SCHEMAS, obj, open_schema
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponseFormat
from kvserve.entrypoints.openai.structured_request import structured_outputs
from kvserve.entrypoints.openai.tool_calls import forced_call_constraint, tool_mode
from kvserve.structured import CompiledGrammar, GrammarCompiler, StructuredOutputsParams
from kvserve.structured.schemas import nest_schema, strict_schema
from model_fixtures import train_tiny_tokenizer

# A string per pattern of the twenty schemas.
PATTERN_EXAMPLES = {
    "^[0-9]{5}$": ["12345", "00000"],
    "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$": ["2024-02-29", "2031-12-01"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Any:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield compiler
    compiler.shutdown()


def response_format(schema: dict[str, Any], strict: bool | None) -> StructuredOutputsParams:
    """The constraint the server reads from a ``json_schema`` response_format."""
    json_schema: dict[str, Any] = {"name": "answer", "schema": schema}
    if strict is not None:
        json_schema["strict"] = strict
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": json_schema})
    params, _ = structured_outputs(SimpleNamespace(response_format=fmt, structured_outputs=None))
    assert params is not None
    return params


def compiled(compiler: GrammarCompiler, params: StructuredOutputsParams) -> CompiledGrammar:
    return compiler.compile(params.spec).result(timeout=30)


def accepts(grammar: CompiledGrammar, tokenizer: Any, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens, one by one, and is then complete."""
    matcher = grammar.new_matcher()
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


def compact(value: Any) -> str:
    """JSON as the grammar writes it: no whitespace, keys by name (the spec sorts them)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def instances(schema: Any, root: dict[str, Any]) -> list[Any]:
    """Values valid under ``schema`` with every listed property present, varied over its choices."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return instances(root["$defs"][name], root)
    if "const" in schema:
        return [schema["const"]]
    if "enum" in schema:
        return list(schema["enum"])
    if "anyOf" in schema:
        return [v for branch in schema["anyOf"] for v in instances(branch, root)]
    kind = schema["type"]
    if kind == "object":
        options = {key: instances(sub, root) for key, sub in schema["properties"].items()}
        count = max(len(values) for values in options.values())
        return [
            {key: values[i % len(values)] for key, values in options.items()} for i in range(count)
        ]
    if kind == "array":
        items = instances(schema["items"], root)
        sizes = sorted({schema.get("minItems", 0), min(schema.get("maxItems", 3), 3)})
        return [list(itertools.islice(itertools.cycle(items), n)) for n in sizes]
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 8) - 1)
        return [low, high] + ([(low + high) / 2 + 0.25] if kind == "number" else [])
    if kind == "boolean":
        return [True, False]
    if kind == "null":
        return [None]
    assert kind == "string", schema
    if "pattern" in schema:
        return PATTERN_EXAMPLES[schema["pattern"]]
    longest = schema.get("maxLength", 12)
    return [
        "x" * schema.get("minLength", 0),
        'a "b" \\ c'[:longest],
        "y" * longest,
    ]


def add_key(value: Any) -> Any:
    """``value`` with a key beyond the listed ones in its first inner object (or itself).

    The key sorts last, after the listed ones, where an open object takes more keys.
    """
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for child in value.values():
            if isinstance(child, dict):
                child["zz_extra"] = 1
                return value
        value["zz_extra"] = 1
    return value


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_strict_accepts_every_generated_instance_and_refuses_extra_keys(
    compiler: GrammarCompiler, tokenizer: Any, name: str
) -> None:
    schema = open_schema(SCHEMAS[name])
    grammar = compiled(compiler, response_format(schema, strict=True))
    strict = strict_schema(schema)
    values = instances(schema, schema)
    assert values
    for value in values:
        jsonschema.validate(value, strict)
        assert accepts(grammar, tokenizer, compact(value)), compact(value)
        if isinstance(value, dict):
            extended = add_key(value)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(extended, strict)
            assert not accepts(grammar, tokenizer, compact(extended)), compact(extended)
            # Whitespace between tokens: refused (the answer is compact JSON).
            assert not accepts(grammar, tokenizer, json.dumps(value, indent=1, sort_keys=True))
            assert not accepts(grammar, tokenizer, json.dumps(value, sort_keys=True))


def test_strict_refuses_another_key_where_the_object_could_end(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    }
    strict = compiled(compiler, response_format(schema, strict=True))
    loose = compiled(compiler, response_format(schema, strict=None))
    prefix = tokenizer.encode('{"n":3,"name":"x"')
    for grammar, comma in ((strict, False), (loose, True)):
        matcher = grammar.new_matcher()
        assert matcher.consume_tokens(prefix)
        assert matcher.validate_tokens(tokenizer.encode(",")) == int(comma)
        assert matcher.validate_tokens(tokenizer.encode("}")) == 1
    # Every listed property is required under strict, optional (as the schema says) without.
    assert not accepts(strict, tokenizer, '{"name":"x"}')
    assert accepts(loose, tokenizer, '{"name":"x"}')
    assert accepts(loose, tokenizer, '{"n":3,"name":"x","more":[1,{"a":null}]}')


@pytest.mark.parametrize("strict", [None, False])
def test_without_strict_the_spec_is_unchanged(strict: bool | None) -> None:
    for schema in map(open_schema, SCHEMAS.values()):
        assert response_format(schema, strict).spec == StructuredOutputsParams(json=schema).spec


def test_strict_keeps_explicit_additional_properties_and_leaves_all_of_open() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
            "both": {"allOf": [obj({"a": {"type": "integer"}}), {"properties": {"b": {}}}]},
            "const": {"const": {"properties": {"data": 1}}},
        },
        "required": ["const"],
    }
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["required"] == ["const", "tags", "both"]
    assert strict["properties"]["tags"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in strict["properties"]["both"]["allOf"][1]
    assert strict["properties"]["const"] == schema["properties"]["const"]  # data, not a schema
    assert "additionalProperties" not in schema  # the caller's schema is left alone


def test_nest_schema_rewrites_local_refs_only() -> None:
    schema = {
        "$defs": {"p": {"type": "integer"}},
        "properties": {
            "a": {"$ref": "#/$defs/p"},
            "self": {"$ref": "#"},
            "remote": {"$ref": "https://example.invalid/s.json"},
            "$ref": {"const": {"$ref": "#/$defs/p"}},
        },
    }
    nested, ref = nest_schema(schema, "tool_f")
    assert ref == {"$ref": "#/$defs/tool_f"}
    props = nested["properties"]
    assert props["a"] == {"$ref": "#/$defs/tool_f/$defs/p"}
    assert props["self"] == {"$ref": "#/$defs/tool_f"}
    assert props["remote"] == {"$ref": "https://example.invalid/s.json"}
    assert props["$ref"] == {"const": {"$ref": "#/$defs/p"}}  # a value, not a reference
    assert schema["properties"]["a"] == {"$ref": "#/$defs/p"}


# A tool with $defs, one reference to the root ("#": a recursive tree), and a second
# tool whose $defs has a name in common with the first's.
TREE = {
    "$defs": {"leaf": {"type": "integer", "minimum": 0, "maximum": 9}},
    **obj(
        {
            "value": {"$ref": "#/$defs/leaf"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        }
    ),
}
FLAG = {"$defs": {"leaf": {"type": "boolean"}}, **obj({"on": {"$ref": "#/$defs/leaf"}})}
TOOLS = [
    {"type": "function", "function": {"name": "tree", "parameters": TREE}},
    {"type": "function", "function": {"name": "flag", "parameters": FLAG, "strict": True}},
]
CALLS = [
    [{"name": "tree", "arguments": {"value": 1, "kids": [{"value": 2, "kids": []}]}}],
    [
        {"name": "flag", "arguments": {"on": True}},
        {"name": "tree", "arguments": {"value": 0, "kids": []}},
    ],
]


@pytest.mark.parametrize(
    "choice",
    ["required", "required-single", {"type": "function", "function": {"name": "tree"}}],
)
def test_tool_schemas_with_defs_compile_under_every_wrapping(
    compiler: GrammarCompiler, tokenizer: Any, choice: Any
) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": TOOLS,
            "tool_choice": "required" if choice == "required-single" else choice,
            "parallel_tool_calls": choice != "required-single",
        }
    )
    mode = tool_mode(body)
    assert mode is not None
    grammar = compiled(compiler, forced_call_constraint(mode, body.parallel_tool_calls))
    schemas = {"tree": TREE, "flag": FLAG}
    if isinstance(choice, dict):
        arguments = CALLS[0][0]["arguments"]
        assert accepts(grammar, tokenizer, compact(arguments))
        assert not accepts(grammar, tokenizer, compact({"value": 10, "kids": []}))
        return
    for calls in CALLS:
        for call in calls:
            jsonschema.validate(call["arguments"], schemas[call["name"]])
        allowed = len(calls) == 1 or choice == "required"  # parallel calls, or just one
        assert accepts(grammar, tokenizer, compact(calls)) == allowed
    # Each tool's own $defs: "leaf" is an integer for tree, a boolean for flag.
    assert not accepts(
        grammar, tokenizer, compact([{"name": "tree", "arguments": {"value": True, "kids": []}}])
    )
    assert not accepts(grammar, tokenizer, compact([{"name": "flag", "arguments": {"on": 1}}]))


def test_a_tokenizer_with_padding_and_truncation_compiles_and_keeps_its_settings() -> None:
    """llguidance is given the tokenizer without its padding and truncation (a two-token
    limit would cut every string it tokenizes); the model's own tokenizer keeps both."""
    tokenizer = train_tiny_tokenizer()
    backend = tokenizer.backend_tokenizer
    backend.enable_padding(length=16)
    backend.enable_truncation(max_length=2)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        schema = {"type": "object", "properties": {"name": {"type": "string"}}}
        grammar = compiled(compiler, response_format(schema, strict=True))
    finally:
        compiler.shutdown()
    assert backend.padding is not None and backend.truncation is not None
    assert backend.truncation["max_length"] == 2
    backend.no_padding()
    backend.no_truncation()
    assert accepts(grammar, tokenizer, compact({"name": "the quick brown fox"}))
    assert not accepts(grammar, tokenizer, compact({"name": "fox", "age": 3}))
