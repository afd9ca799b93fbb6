"""The server's prompt logprobs: vLLM's ``prompt_logprobs`` field and OpenAI's ``echo`` with
``logprobs``, on the real SmolLM2 model.

The offline ``LLM`` computes the reference first (its prompt logprobs are
checked against transformers in ``tests/engine/test_prompt_logprobs.py``);
then its engine is served, so both sides run the same weights and the
values must be equal.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.outputs import RequestOutput

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is Paris, and the capital of Italy is"
CHAT = [{"role": "user", "content": "Name a colour."}]
NUM_TOKENS = 4
NUM_TOP = 2
ATOL = 1e-5


@pytest.fixture(scope="module")
def served(start_server: Any) -> Iterator[tuple[str, RequestOutput]]:
    llm = LLM(MODEL, dtype="float32", num_blocks=256)
    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP
    )
    (reference,) = llm.generate([PROMPT], params, use_tqdm=False)
    server = start_server(build_app(llm.llm_engine, ServerConfig(served_model_name=MODEL)))
    yield server.url, reference


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json={"model": MODEL, **body}, timeout=120)


def streamed(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream(
        "POST", f"{url}/v1/{path}", json={"model": MODEL, "stream": True, **body}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0, **fields}


def assert_vllm_shape(body: list[Any], reference: RequestOutput) -> None:
    expected = reference.prompt_logprobs
    assert expected is not None and len(body) == len(expected)
    assert body[0] is None
    for position, (entry, want) in enumerate(zip(body[1:], expected[1:], strict=True), start=1):
        assert want is not None
        assert set(entry) == {str(token_id) for token_id in want}, position
        for token_id, value in want.items():
            got = entry[str(token_id)]
            assert abs(got["logprob"] - value.logprob) <= ATOL
            assert got["rank"] == value.rank
            assert got["decoded_token"] == value.decoded_token


def test_completions_return_prompt_logprobs_as_vllm_does(
    served: tuple[str, RequestOutput],
) -> None:
    url, reference = served
    response = post(url, "completions", completion(prompt_logprobs=NUM_TOP))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert_vllm_shape(choice["prompt_logprobs"], reference)
    assert choice["text"] == reference.outputs[0].text
    # Streamed: one chunk carries them, ahead of the completion's text.
    chunks = streamed(url, "completions", completion(prompt_logprobs=NUM_TOP))
    carrying = [c for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0]]
    assert len(carrying) == 1 and carrying[0] is chunks[0]
    assert_vllm_shape(carrying[0]["choices"][0]["prompt_logprobs"], reference)
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference.outputs[0].text


def expected_echo(reference: RequestOutput) -> tuple[list[float | None], list[str]]:
    """The echoed prompt's then the completion's token logprobs, and their texts' tops."""
    prompt_logprobs = reference.prompt_logprobs
    assert prompt_logprobs is not None
    completion_logprobs = reference.outputs[0].logprobs
    assert completion_logprobs is not None
    values: list[float | None] = [None]
    tokens = []
    ids = reference.prompt_token_ids[1:] + reference.outputs[0].token_ids
    for token_id, entry in zip(ids, prompt_logprobs[1:] + completion_logprobs, strict=True):
        assert entry is not None
        values.append(entry[token_id].logprob)
        tokens.append(entry[token_id].decoded_token or "")
    return values, tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_puts_the_prompt_tokens_first(
    served: tuple[str, RequestOutput], stream: bool
) -> None:
    url, reference = served
    body = completion(echo=True, logprobs=NUM_TOP)
    if stream:
        chunks = streamed(url, "completions", body)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        logprobs: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        logprobs["text_offset"] = []
        for chunk in chunks:
            part = chunk["choices"][0]["logprobs"]
            for name in logprobs:
                logprobs[name] += part[name] if part else []
        # The prompt leads, with its logprobs: the first chunk holds it whole.
        assert chunks[0]["choices"][0]["text"] == PROMPT
    else:
        response = post(url, "completions", body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
        assert choice["prompt_logprobs"] is None  # not asked for by name
    assert text == PROMPT + reference.outputs[0].text
    values, tokens = expected_echo(reference)
    num_prompt = len(reference.prompt_token_ids)
    assert len(logprobs["tokens"]) == num_prompt + NUM_TOKENS
    assert logprobs["tokens"][1:] == tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for got, want in zip(logprobs["token_logprobs"][1:], values[1:], strict=True):
        assert want is not None and abs(got - want) <= ATOL
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][num_prompt] == len(PROMPT)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_chat_returns_prompt_logprobs_of_the_rendered_conversation(
    served: tuple[str, RequestOutput],
) -> None:
    url, _ = served
    body = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    response = post(url, "chat/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    prompt_logprobs = answer["prompt_logprobs"]
    assert len(prompt_logprobs) == answer["usage"]["prompt_tokens"]
    assert prompt_logprobs[0] is None
    assert all(len(entry) == 1 for entry in prompt_logprobs[1:])
    chunks = streamed(url, "chat/completions", body)
    carrying = [c for c in chunks if "prompt_logprobs" in c]
    assert len(carrying) == 1
    assert carrying[0]["prompt_logprobs"] == prompt_logprobs
    # Without the field, neither the answer nor its chunks carry it.
    plain = post(url, "chat/completions", {**body, "prompt_logprobs": None}).json()
    assert plain["prompt_logprobs"] is None


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("value", [21, -1, "2"])
def test_bad_prompt_logprobs_get_a_400_naming_the_field(
    served: tuple[str, RequestOutput], path: str, value: Any
) -> None:
    url, _ = served
    body: dict[str, Any] = {"max_tokens": 1, "prompt_logprobs": value}
    body.update({"prompt": PROMPT} if path == "completions" else {"messages": CHAT})
    response = post(url, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt_logprobs", error


def test_each_streamed_choice_opens_with_its_own_prompt_once(
    served: tuple[str, RequestOutput],
) -> None:
    url, reference = served
    prompts = [PROMPT, "Hello there"]
    body = completion(prompt=prompts, n=2, echo=True, logprobs=1, prompt_logprobs=0)
    chunks = streamed(url, "completions", body)
    by_choice: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == [0, 1, 2, 3]
    for index, parts in by_choice.items():
        prompt = prompts[index // 2]
        first = parts[0]
        # The prompt comes first, once, with its logprobs and vLLM's prompt_logprobs.
        assert first["text"] == prompt
        assert sum(part["text"] == prompt for part in parts) == 1
        num_prompt = len(first["prompt_logprobs"])
        assert first["prompt_logprobs"][0] is None
        assert len(first["logprobs"]["tokens"]) == num_prompt
        assert first["logprobs"]["token_logprobs"][0] is None
        assert all("prompt_logprobs" not in part for part in parts[1:])
    # The first prompt's echoed logprobs are the offline engine's.
    first = by_choice[0][0]
    prompt_tokens = expected_echo(reference)[1][: len(reference.prompt_token_ids) - 1]
    assert first["logprobs"]["tokens"][1:] == prompt_tokens
