"""POST /tokenize and /detokenize against the tokenizer and chat template they wrap."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvserve.chat.encode import encode_chat


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    return start_tiny_server()


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_prompt_tokens_and_back(server: Any) -> None:
    tokenizer = server.async_engine.tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    response = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.async_engine.max_model_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_messages_are_rendered_as_chat_completions_renders_them(server: Any) -> None:
    tokenizer = server.async_engine.tokenizer
    messages = [{"role": "user", "content": "hello there"}]
    response = post(server, "/tokenize", {"messages": messages})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == encode_chat(tokenizer, messages, add_generation_prompt=True)
    assert response.json()["token_strs"] is None
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare.json()["tokens"] == encode_chat(tokenizer, messages, add_generation_prompt=False)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "unknown": 1}, "unknown"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_bodies_get_a_400_naming_the_field(
    server: Any, path: str, body: dict[str, Any], param: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
