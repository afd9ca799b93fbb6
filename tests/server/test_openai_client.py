"""The official ``openai`` client against a live server running the real SmolLM2 model.

The model is loaded once: the offline ``LLM`` computes the reference outputs
first, then its engine is served over HTTP, so both sides run the same
weights in the same dtype. Greedy decoding makes the comparison exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.outputs import RequestOutput

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def served(start_server: Any) -> Iterator[tuple[Any, dict[str, RequestOutput]]]:
    llm = LLM(MODEL, dtype="float32", num_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    references = dict(zip(PROMPTS, llm.generate(PROMPTS, greedy, use_tqdm=False), strict=True))
    references["chat"] = llm.chat(CHAT, greedy, use_tqdm=False)[0]
    # From here on the loop thread owns the engine; the offline API is not used again.
    yield start_server(build_app(llm.llm_engine, ServerConfig(served_model_name=MODEL))), references


@pytest.fixture(scope="module")
def client(served: tuple[Any, dict[str, RequestOutput]]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def references(served: tuple[Any, dict[str, RequestOutput]]) -> dict[str, RequestOutput]:
    return served[1]


def greedy(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": NUM_TOKENS, "temperature": 0, **fields}


def test_greedy_completions_equal_llm_generate(
    client: openai.OpenAI, references: dict[str, RequestOutput]
) -> None:
    response = client.completions.create(prompt=PROMPTS, **greedy())
    assert [choice.index for choice in response.choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, response.choices, strict=True):
        expected = references[prompt].outputs[0]
        assert choice.text == expected.text
        assert choice.finish_reason == expected.finish_reason
    assert response.usage is not None
    assert response.usage.prompt_tokens == sum(len(references[p].prompt_token_ids) for p in PROMPTS)
    assert response.usage.completion_tokens == sum(
        len(references[p].outputs[0].token_ids) for p in PROMPTS
    )
    assert response.usage.total_tokens == response.usage.prompt_tokens + (
        response.usage.completion_tokens
    )


def test_streamed_completion_adds_up_to_the_same_text_and_usage(
    client: openai.OpenAI,
    references: dict[str, RequestOutput],
    served: tuple[Any, dict[str, RequestOutput]],
) -> None:
    prompt = PROMPTS[0]
    stream = client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy()
    )
    chunks = list(stream)
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    expected = references[prompt]
    assert text == expected.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == expected.outputs[0].finish_reason
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.prompt_tokens == len(served[0].async_engine.tokenizer.encode(prompt))
    assert usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_greedy_chat_equals_llm_chat_streamed_or_not(
    client: openai.OpenAI, references: dict[str, RequestOutput]
) -> None:
    expected = references["chat"]
    response = client.chat.completions.create(messages=CHAT, **greedy())  # type: ignore[arg-type]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    stream = client.chat.completions.create(
        messages=CHAT,  # type: ignore[arg-type]
        stream=True,
        **greedy(max_tokens=None, max_completion_tokens=NUM_TOKENS),
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason


def test_n_2_gives_two_choices_whose_tokens_add_up_to_the_usage(client: openai.OpenAI) -> None:
    response = client.completions.create(
        prompt=PROMPTS[0], n=2, seed=7, logprobs=0, **greedy(temperature=1.0)
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    num_tokens = [len(choice.logprobs.tokens) for choice in response.choices]  # type: ignore[union-attr]
    assert response.usage is not None and response.usage.completion_tokens == sum(num_tokens)
    stream = client.chat.completions.create(
        messages=CHAT,  # type: ignore[arg-type]
        n=2,
        stream=True,
        **greedy(max_tokens=8, temperature=1.0, seed=3),
    )
    finished = {
        c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason
    }
    assert set(finished) == {0, 1}


def test_stop_string_cuts_the_text_streamed_or_not(
    client: openai.OpenAI, references: dict[str, RequestOutput]
) -> None:
    full = references[PROMPTS[1]].outputs[0].text
    stop = full[12:17]  # five characters, likely spanning tokens
    expected = full[: full.index(stop)]
    response = client.completions.create(prompt=PROMPTS[1], stop=[stop], **greedy())
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    stream = client.completions.create(prompt=PROMPTS[1], stop=stop, stream=True, **greedy())
    pieces = [choice.text for chunk in stream for choice in chunk.choices]
    assert "".join(pieces) == expected  # nothing of the stop string was sent and taken back


def test_completion_logprobs_are_consistent(client: openai.OpenAI) -> None:
    response = client.completions.create(prompt=PROMPTS[0], logprobs=3, **greedy())
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
    assert response.usage is not None and len(logprobs.tokens) == response.usage.completion_tokens
    assert "".join(logprobs.tokens) == choice.text
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert token_logprob is not None and token_logprob <= 0
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(token_logprob)  # greedy took the top token


def test_chat_logprobs_are_consistent(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        messages=CHAT,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        **greedy(max_tokens=8),
    )
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and response.usage is not None
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())


def test_penalties_change_the_output(client: openai.OpenAI) -> None:
    prompt = "one two one two one two one two"
    plain = client.completions.create(prompt=prompt, **greedy()).choices[0].text
    for penalty in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        penalized = client.completions.create(prompt=prompt, **greedy(**penalty))
        assert penalized.choices[0].text != plain, penalty


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    response = client.completions.create(prompt=PROMPTS[0], echo=True, **greedy(max_tokens=4))
    assert response.choices[0].text.startswith(PROMPTS[0])
    assert len(response.choices[0].text) > len(PROMPTS[0])
