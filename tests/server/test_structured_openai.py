"""Structured outputs through the official ``openai`` client against the real SmolLM2.

Twenty varied JSON schemas (nested objects, arrays, enums, bounded numbers,
required and optional fields), greedy and sampled: every answer parses and
validates against its schema (the ``jsonschema`` package, independent of the
grammar engine). Choices always return one of the choices; regexes always
match (Python's ``re``). Requests go out concurrently, so they share batches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jsonschema
import openai
import pytest

from kvserve import LLM
from kvserve.benchmarks.workloads.structured_schemas import NAME, SCHEMAS, obj
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
T = TypeVar("T")


DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def client(start_server: Any) -> openai.OpenAI:
    # The file's weights dequantized: the tests' expected completions were written for them.
    llm = LLM(MODEL, dtype="bfloat16", quantization="none", num_blocks=512)
    server = start_server(build_app(llm.llm_engine, ServerConfig(served_model_name=MODEL)))
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def all_at_once(calls: list[Callable[[], T]]) -> list[T]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def ask_json(client: openai.OpenAI, name: str, schema: dict[str, Any], **sampling: Any) -> Any:
    messages = [{"role": "user", "content": f"Reply with a JSON example of a {name}."}]
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name.replace(" ", "_"), "schema": schema, "strict": True},
        },
        max_tokens=160,
        **sampling,
    )


def test_twenty_schemas_greedy_and_sampled_all_validate(client: openai.OpenAI) -> None:
    calls: list[Callable[[], Any]] = []
    cases: list[tuple[str, dict[str, Any]]] = []
    for name, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        cases.append((name, schema))
        calls.append(lambda n=name, s=schema: ask_json(client, n, s, temperature=0))
    for index, (name, schema) in enumerate(list(SCHEMAS.items())[:6]):
        cases.append((f"{name} (sampled)", schema))
        calls.append(
            lambda n=name, s=schema, i=index: ask_json(client, n, s, temperature=1.0, seed=i)
        )
    for (name, schema), response in zip(cases, all_at_once(calls), strict=True):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        value = json.loads(choice.message.content or "")
        jsonschema.validate(value, schema)


def test_json_object_in_chat_and_a_schema_on_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as a short JSON object."}],
        max_tokens=160,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    schema = SCHEMAS["mixed types"]
    completion = client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a book:",
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )
    assert completion.choices[0].finish_reason == "stop", completion.choices[0].text
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


def test_choice_and_regex_always_hold(client: openai.OpenAI) -> None:
    choices = ["positive", "negative", "neutral"]

    def ask(constraint: dict[str, Any], question: str, **sampling: Any) -> str:
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=40,
            extra_body={"structured_outputs": constraint},
            **sampling,
        )
        return response.choices[0].message.content or ""

    calls: list[Callable[[], str]] = []
    for seed in range(3):
        sampled = {"temperature": 1.0, "seed": seed}
        calls.append(lambda s=sampled: ask({"choice": choices}, "Is 'I love it' positive?", **s))
        calls.append(lambda s=sampled: ask({"regex": DATE}, "When is the next new year?", **s))
        calls.append(lambda s=sampled: ask({"regex": PHONE}, "Give a phone number.", **s))
    greedy = {"temperature": 0}
    calls.append(lambda: ask({"choice": choices}, "Is 'I hate it' positive?", **greedy))
    calls.append(lambda: ask({"regex": DATE}, "Today's date?", **greedy))
    answers = all_at_once(calls)
    for index, answer in enumerate(answers):
        kind = index % 3 if index < 9 else index - 9
        if kind == 0:
            assert answer in choices
        else:
            assert re.fullmatch(DATE if kind == 1 else PHONE, answer), answer


def test_streamed_constrained_output_matches_the_whole_one(client: openai.OpenAI) -> None:
    schema = SCHEMAS["person"]
    whole = ask_json(client, "person", schema, temperature=0).choices[0].message.content
    messages = [{"role": "user", "content": "Reply with a JSON example of a person."}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema},
        },
        max_tokens=160,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": obj({"timezone": {"type": "string", "maxLength": 32}}),
    },
}
TOOLS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def assert_valid_calls(message: Any) -> None:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        schema = TOOLS[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_required_and_named_tool_calls_parse_into_declared_arguments(
    client: openai.OpenAI,
) -> None:
    def ask(tool_choice: Any, **sampling: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,  # type: ignore[arg-type]
            tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice=tool_choice,
            max_tokens=120,
            **sampling,
        )

    named = {"type": "function", "function": {"name": "get_time"}}
    calls: list[Callable[[], Any]] = [lambda: ask("required", temperature=0)]
    calls += [lambda s=s: ask("required", temperature=1.0, seed=s) for s in range(3)]
    calls += [lambda: ask(named, temperature=0), lambda: ask(named, temperature=1.0, seed=5)]
    responses = all_at_once(calls)
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message)
    for response in responses[-2:]:
        assert [call.function.name for call in response.choices[0].message.tool_calls] == [
            "get_time"
        ]
    # Streamed: the same calls as the same request alone, as tool-call deltas.
    whole = ask("required", temperature=0).choices[0].message.tool_calls
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [call for d in deltas for call in d.delta.tool_calls or []]
    assert streamed and all(call.id and call.type == "function" for call in streamed)
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert deltas[-1].finish_reason == "tool_calls"


def test_tool_results_go_back_through_the_template(client: openai.OpenAI) -> None:
    messages = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    for tool_choice in ("none", "auto"):
        response = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=tool_choice,  # type: ignore[arg-type]
            max_tokens=40,
            temperature=0,
        )
        message = response.choices[0].message
        if tool_choice == "none" or not message.tool_calls:
            assert message.content and not message.tool_calls
        else:
            assert_valid_calls(message)


# Parameters with their own $defs, referenced from the root: under tool_choice "required"
# the schema sits inside the list-of-calls wrapper, where its $refs must still resolve.
ROUTE = {
    "type": "function",
    "function": {
        "name": "plan_route",
        "description": "A route between two cities.",
        "parameters": {
            "$defs": {"place": obj({"city": NAME, "country": {"type": "string", "maxLength": 24}})},
            **obj({"from": {"$ref": "#/$defs/place"}, "to": {"$ref": "#/$defs/place"}}),
        },
    },
}


def test_a_tool_with_defs_is_called_under_required(client: openai.OpenAI) -> None:
    schemas = {name: tool["function"]["parameters"] for name, tool in TOOLS.items()}
    schemas["plan_route"] = ROUTE["function"]["parameters"]
    messages = [{"role": "user", "content": "Plan a route from Paris to Berlin."}]
    calls: list[Callable[[], Any]] = [
        lambda sampling=sampling: client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[ROUTE, WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=160,
            **sampling,
        )
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1})
    ]
    for response in all_at_once(calls):
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert choice.message.tool_calls
