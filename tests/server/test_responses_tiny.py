"""``/v1/responses`` through the official ``openai`` client on the tiny model.

The tiny random model writes nonsense, so these tests check what does not
depend on its words: a streamed response adds up to the whole one and its
events come in the order OpenAI's client expects; the prompt a response
was computed from is the chat conversation it stands for (counted by
``/tokenize`` on the equivalent chat messages), so ``previous_response_id``
and tool results demonstrably reach the model; forced tool calls parse into
arguments that satisfy their schema (``jsonschema``); stored responses belong
to one API key; and what kvserve does not implement is refused by name.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

KEY_A = "responses-key-a"
KEY_B = "responses-key-b"
UNIT = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": UNIT}


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    # The tools prompt is long in the tiny tokenizer's few hundred tokens.
    return start_tiny_server(engine_args={"max_model_len": 512}, api_keys=(KEY_A, KEY_B))


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0)


@pytest.fixture(scope="module")
def client_b(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_B, max_retries=0)


def num_chat_tokens(server: Any, messages: list[dict[str, Any]], **fields: Any) -> int:
    """The prompt tokens of these chat messages, as /tokenize renders them."""
    body = {"messages": messages, "add_generation_prompt": True, **fields}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    response = httpx.post(f"{server.url}/tokenize", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return int(response.json()["count"])


def post(server: Any, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=60)


def test_streamed_response_adds_up_to_the_whole_one(client: openai.OpenAI, server: Any) -> None:
    fields: dict[str, Any] = {
        "model": "tiny",
        "input": "hello there",
        "instructions": "Be brief.",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    whole = client.responses.create(**fields)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete"  # the random model never stops in 12 tokens
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 12
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    assert whole.usage.input_tokens == num_chat_tokens(server, messages)
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output_text

    events = list(client.responses.create(**fields, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage == whole.usage
    assert final.id != whole.id
    # The streamed response was stored once it ended.
    assert client.responses.retrieve(final.id).output_text == text


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, server: Any
) -> None:
    first = client.responses.create(
        input="hello", instructions="Answer in French.", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "and again"}]}],
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # The second prompt is the first turn (less its instructions, as at OpenAI), the
    # first answer and the new input: counted independently through /tokenize.
    conversation = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and again"},
    ]
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens == num_chat_tokens(server, conversation)
    alone = num_chat_tokens(server, conversation[2:])
    assert second.usage.input_tokens > alone + first.usage.output_tokens
    # A chain: the third turn sees both earlier ones.
    third = client.responses.create(
        input="once more", previous_response_id=second.id, max_output_tokens=4, temperature=0
    )
    conversation += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "once more"},
    ]
    assert third.usage is not None
    assert third.usage.input_tokens == num_chat_tokens(server, conversation)


def test_store_false_keeps_nothing_and_unknown_ids_are_404(client: openai.OpenAI) -> None:
    unstored = client.responses.create(input="hi", max_output_tokens=2, store=False)
    for call in (
        lambda: client.responses.retrieve(unstored.id),
        lambda: client.responses.delete("resp_nope"),
        lambda: client.responses.create(input="hi", previous_response_id="resp_nope"),
    ):
        with pytest.raises(openai.NotFoundError) as raised:
            call()
        error = raised.value.body
        assert isinstance(error, dict) and error["type"] == "invalid_request_error"
        assert error["code"] == "not_found" and "resp_" in error["message"]
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(input="hi", previous_response_id="resp_nope")
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["param"] == "previous_response_id"


def test_stored_responses_belong_to_their_api_key(
    client: openai.OpenAI, client_b: openai.OpenAI
) -> None:
    mine = client.responses.create(input="secret", max_output_tokens=3, temperature=0)
    assert client.responses.retrieve(mine.id).output_text == mine.output_text
    for call in (
        lambda: client_b.responses.retrieve(mine.id),
        lambda: client_b.responses.delete(mine.id),
        lambda: client_b.responses.create(input="x", previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # Still there for its own key, until that key deletes it.
    assert client.responses.retrieve(mine.id).id == mine.id
    client.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine.id)


def test_forced_tool_calls_parse_into_arguments_that_fit_the_schema(
    client: openai.OpenAI,
) -> None:
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        response = client.responses.create(
            input="weather in Paris?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            # One call: the random model would otherwise go on calling up to the limit.
            parallel_tool_calls=False,
            max_output_tokens=120,
            temperature=0,
        )
        assert response.parallel_tool_calls is False
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1 and response.status == "completed", (response.output, response.usage)
        assert [item.type for item in response.output] == ["function_call"] * len(calls)
        for call in calls:
            assert call.call_id.startswith("call") and call.status == "completed"
            assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), UNIT)
    # Streamed: the same calls, as function-call items with their argument events.
    events = list(
        client.responses.create(
            input="weather in Paris?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=120,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    item = events[-2].item  # type: ignore[union-attr]
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.arguments == events[3].delta == events[4].arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(item.arguments), UNIT)


def test_a_tool_loop_continues_with_the_calls_and_their_results(
    client: openai.OpenAI, server: Any
) -> None:
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"unit": "celsius"}',
    }
    result = {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}
    response = client.responses.create(
        input=[{"role": "user", "content": "weather?"}, call, result],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}}]
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    assert response.usage is not None
    assert response.usage.input_tokens == num_chat_tokens(server, messages, tools=chat_tools)
    # The output of one response goes back as input, as the SDK's tool loops do.
    again = client.responses.create(
        input=[{"role": "user", "content": "weather?"}, *response.output],  # type: ignore[list-item]
        max_output_tokens=2,
    )
    assert again.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": []}]}, "tools[1].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"tool_choice": {"type": "web_search"}, "tools": [WEATHER]}, "tool_choice.type"),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
            "tool_choice.name",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"input": []}, "input"),
        ({"max_token": 5}, "max_token"),
        ({"metadata": {str(i): "x" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "x" * 513}}, "metadata.k"),
    ],
)
def test_what_kvserve_does_not_do_is_refused_by_name(
    server: Any, fields: dict[str, Any], param: str
) -> None:
    response = post(server, {"input": "hi", "max_output_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    server.wait_idle()


def test_harmless_values_of_unsupported_fields_are_accepted(server: Any) -> None:
    body = {
        "input": "hi",
        "max_output_tokens": 2,
        "background": False,
        "include": [],
        "truncation": "disabled",
        "metadata": {"run": "7"},
    }
    response = post(server, body)
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"run": "7"}


@pytest.fixture(scope="module")
def failing_server(start_tiny_server: Any) -> Any:
    """A server whose steps fail for any request with ``fail`` in its id (see ``failing``)."""
    server = start_tiny_server()
    runner = server.async_engine.engine.runner
    execute = runner.execute
    failing: set[str] = set()

    def poisoned_execute(scheduler_output: Any) -> Any:
        for item in scheduler_output.scheduled:
            if item.request.request_id in failing:
                raise RuntimeError("injected fault")
        return execute(scheduler_output)

    runner.execute = poisoned_execute
    server.failing = failing
    return server


def test_a_failure_after_the_200_is_an_error_event_and_nothing_is_stored(
    failing_server: Any,
) -> None:
    engine = failing_server.async_engine
    generate = engine.generate

    def generate_failing(requests: Any) -> Any:
        failing_server.failing.update(request.request_id for request in requests)
        return generate(requests)

    engine.generate = generate_failing
    try:
        body = {"input": "hi", "max_output_tokens": 8, "stream": True}
        with httpx.stream(
            "POST", f"{failing_server.url}/v1/responses", json=body, timeout=30
        ) as response:
            assert response.status_code == 200
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        engine.generate = generate
    events = [json.loads(line) for line in lines]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "generation_failed"
    assert "error id" in error["message"] and "injected" not in error["message"]
    response_id = events[0]["response"]["id"]
    gone = httpx.get(f"{failing_server.url}/v1/responses/{response_id}")
    assert gone.status_code == 404
    failing_server.wait_idle()
