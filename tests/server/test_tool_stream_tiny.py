"""Tool calling on the tiny model: with tool_choice "auto" a streamed answer loses no text.

The random model never writes a ``<tool_call>`` block, so every character of
its answer is content: streamed (pieces through the streaming parser, which
holds back anything that could open a block) and whole must be equal.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    # The tools prompt is long in the tiny tokenizer's few hundred tokens.
    return start_tiny_server(engine_args={"max_model_len": 512})


def test_streamed_auto_answer_equals_the_whole_one(server: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "tools": [TOOL],
        "max_tokens": 24,
        "temperature": 0,
    }
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
    assert "choices" in whole, whole
    message = whole["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["content"]
    text = ""
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                assert "tool_calls" not in delta
                text += delta.get("content") or ""
    assert text == message["content"]
    assert whole["choices"][0]["finish_reason"] == "length"
