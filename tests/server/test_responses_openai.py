"""``/v1/responses`` through the official ``openai`` client against the real SmolLM2.

References are computed offline first (``LLM.chat`` on the conversation a
response stands for, greedy), then the same engine is served: a response,
whole or streamed, must be that answer token for token, and a continued
conversation (``previous_response_id``) must be the offline answer to the
whole conversation, which shows the second turn saw the first. Structured
output is validated with ``jsonschema``; tool calls are parsed into
arguments that fit their schemas, both under ``tool_choice="required"`` and
under ``"auto"``, where earlier turns of the conversation show the model
the calls (a few-shot prompt that SmolLM2 follows greedily).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.workloads.structured_schemas import NAME, SCHEMAS, obj
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.outputs import RequestOutput

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NUM_TOKENS = 24
INSTRUCTIONS = "You are a geography teacher. Answer briefly."
FIRST = "What is the capital of France?"
SECOND = "And of Italy?"
CITY = obj({"city": NAME})
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": CITY,
}
CLOCK = {
    "type": "function",
    "name": "get_time",
    "description": "The time now in a time zone.",
    "parameters": obj({"timezone": {"type": "string", "maxLength": 32}}),
}
SCHEMA_OF = {"get_weather": CITY, "get_time": CLOCK["parameters"]}


def few_shot_weather(question: str) -> list[dict[str, Any]]:
    """Earlier turns where the assistant called get_weather, then ``question``."""
    items: list[dict[str, Any]] = []
    for index, city in enumerate(("Paris", "Rome", "Berlin")):
        call_id = f"call_{index}"
        items += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "get_weather",
                "arguments": json.dumps({"city": city}),
            },
            {"type": "function_call_output", "call_id": call_id, "output": "18 degrees and sunny"},
            {"role": "assistant", "content": f"It is 18 degrees and sunny in {city}."},
        ]
    return [*items, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def served(start_server: Any) -> Iterator[tuple[openai.OpenAI, dict[str, RequestOutput]]]:
    llm = LLM(MODEL, dtype="float32", num_blocks=512)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)

    def chat(messages: list[dict[str, Any]]) -> RequestOutput:
        return llm.chat(messages, greedy, use_tqdm=False)[0]

    references = {"first": chat([{"role": "user", "content": FIRST}])}
    first_text = references["first"].outputs[0].text
    references["instructed"] = chat(
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": FIRST}]
    )
    references["second"] = chat(
        [
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": first_text},
            {"role": "user", "content": SECOND},
        ]
    )
    # From here on the loop thread owns the engine; the offline API is not used again.
    server = start_server(build_app(llm.llm_engine, ServerConfig(served_model_name=MODEL)))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client, references


@pytest.fixture(scope="module")
def client(served: tuple[openai.OpenAI, dict[str, RequestOutput]]) -> openai.OpenAI:
    return served[0]


@pytest.fixture(scope="module")
def references(served: tuple[openai.OpenAI, dict[str, RequestOutput]]) -> dict[str, RequestOutput]:
    return served[1]


def greedy(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": NUM_TOKENS, "temperature": 0, **fields}


def test_greedy_response_equals_llm_chat_streamed_or_not(
    client: openai.OpenAI, references: dict[str, RequestOutput]
) -> None:
    expected = references["instructed"]
    whole = client.responses.create(input=FIRST, instructions=INSTRUCTIONS, **greedy())
    assert whole.output_text == expected.outputs[0].text
    assert whole.usage is not None
    assert whole.usage.input_tokens == len(expected.prompt_token_ids)
    assert whole.usage.output_tokens == len(expected.outputs[0].token_ids)
    finished = expected.outputs[0].finish_reason
    assert whole.status == ("incomplete" if finished == "length" else "completed")
    assert whole.instructions == INSTRUCTIONS and whole.model == MODEL

    events = list(
        client.responses.create(input=FIRST, instructions=INSTRUCTIONS, stream=True, **greedy())
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.output_text == whole.output_text
    assert final.response.usage == whole.usage


def test_previous_response_id_continues_with_the_first_turn_in_the_prompt(
    client: openai.OpenAI, references: dict[str, RequestOutput]
) -> None:
    first = client.responses.create(input=FIRST, **greedy())
    assert first.output_text == references["first"].outputs[0].text
    second = client.responses.create(input=SECOND, previous_response_id=first.id, **greedy())
    expected = references["second"]
    assert second.output_text == expected.outputs[0].text
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens == len(expected.prompt_token_ids)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    stored = client.responses.retrieve(second.id)
    assert stored.output_text == second.output_text and stored.previous_response_id == first.id


@pytest.mark.parametrize("name", ["person", "array of objects", "nullable", "refs"])
def test_json_schema_format_answers_validate(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    text_format = {"type": "json_schema", "name": name.replace(" ", "_"), "schema": schema}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9}):
        response = client.responses.create(
            model=MODEL,
            input=f"Reply with a JSON example of a {name}.",
            text={"format": {**text_format, "strict": True}},  # type: ignore[typeddict-item]
            max_output_tokens=160,
            **sampling,
        )
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text is not None and response.text.format is not None
        assert response.text.format.type == "json_schema"


def test_json_object_format_answers_an_object(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Reply with a JSON object with the keys name and colour of a cat.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=160,
        temperature=0,
    )
    assert response.status == "completed", response.output_text
    assert isinstance(json.loads(response.output_text), dict)


def test_required_tool_calls_parse_into_declared_arguments(client: openai.OpenAI) -> None:
    # Sampled, the answer is held to one call: a list of calls has no length the grammar
    # bounds, and a draw that keeps adding calls runs past any token budget, while one
    # call's strings (at most 24 or 32 characters) always close well within it.
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "parallel_tool_calls": False}):
        response = client.responses.create(
            model=MODEL,
            input="What is the weather in Paris right now?",
            tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice="required",
            max_output_tokens=120,
            **sampling,  # type: ignore[arg-type]
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and response.status == "completed", response.output
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])


def test_auto_tool_call_then_its_result_continues_the_loop(client: openai.OpenAI) -> None:
    fields = greedy(tools=[WEATHER], max_output_tokens=60)
    response = client.responses.create(
        input=few_shot_weather("What is the weather in London?"), **fields
    )
    assert [item.type for item in response.output] == ["function_call"], response.output
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "London"}
    jsonschema.validate(json.loads(call.arguments), CITY)

    events = list(
        client.responses.create(
            input=few_shot_weather("What is the weather in London?"), stream=True, **fields
        )
    )
    kinds = [event.type for event in events]
    assert "response.output_text.delta" not in kinds
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    streamed = events[-2].item  # type: ignore[union-attr]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)

    # The tool's result, continuing from the stored response: the answer is text.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "7 degrees, rain"}
    answer = client.responses.create(
        input=[result],  # type: ignore[list-item]
        previous_response_id=response.id,
        tool_choice="none",
        **fields,
    )
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text
    assert answer.usage is not None and response.usage is not None
    assert answer.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens
