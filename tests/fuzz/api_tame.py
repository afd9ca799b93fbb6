"""Taming: turn some of schemathesis's valid-by-the-document bodies into requests that run.

The document gives types, not ranges (those live in ``SamplingParams``), so
nearly every generated body has some number out of range, an unknown model,
an empty prompt or a token id past the vocabulary, and gets its 400 before
reaching the engine. The fuzzer tames half of the valid cases: it keeps the
fields schemathesis chose and their strings (stop strings, cache_salt,
message text, ...) but draws numbers from typical values, drops ``model``,
keeps prompts and messages few, short and non-empty, folds token ids into
the 256 ids every vocabulary has, and streams half the time. Those requests
reach the engine: streams, logprobs, n > 1, stop strings, seeds, penalties,
preemption on the small KV pool.
"""

from __future__ import annotations

import random
from typing import Any

# A few values per numeric field, valid ones and edges (top_k 0, seed 2^63 - 1, penalties at 2).
TYPICAL_VALUES: dict[str, list[Any]] = {
    "n": [1, 2, 3, 8],
    "temperature": [0, 0.0, 0.7, 1, 2.5],
    "top_p": [0.05, 0.9, 1],
    "top_k": [-1, 0, 1, 5],
    "min_p": [0, 0.2, 1],
    "seed": [0, 7, 2**63 - 1],
    "presence_penalty": [-2, 0, 1.5, 2],
    "frequency_penalty": [-2, 0, 0.5, 2],
    "repetition_penalty": [0.5, 1, 1.3],
    "min_tokens": [0, 1, 3],
    "max_tokens": [None, 1, 3, 16],
    "max_completion_tokens": [None, 1, 5],
    "top_logprobs": [0, 2, 20],
    "prompt_logprobs": [None, 0, 1, 5],
}
COMPLETION_LOGPROBS = [0, 1, 5, 20]  # chat's logprobs is a bool, left as generated
UNSUPPORTED = ("model", "logit_bias", "suffix", "best_of")
# Constraints whose validity the document cannot express (a schema that compiles, a
# regex, a tool name that exists): left out of tamed bodies, fuzzed untamed.
CONSTRAINTS = ("response_format", "structured_outputs", "tools", "tool_choice")
MAX_ITEMS = 4  # prompts, messages, stop strings, stop token ids
MAX_TEXT_CHARS = 24  # the tiny model's context is 64 tokens
NUM_SAFE_TOKEN_IDS = 256
FILLER = "Hello there"


def tame_body(path: str, body: Any, rng: random.Random) -> Any:
    """A copy of ``body`` that the server should accept (most of the time)."""
    if not isinstance(body, dict):
        return body
    tamed = {key: value for key, value in body.items() if key not in UNSUPPORTED}
    if path == "/tokenize":
        return _tame_tokenize(tamed)
    if path == "/detokenize":
        if isinstance(tamed.get("tokens"), list):
            tamed["tokens"] = [_token_id(token) for token in tamed["tokens"]]
        return tamed
    for name in CONSTRAINTS:
        tamed.pop(name, None)
    for name, values in TYPICAL_VALUES.items():
        if name in tamed:
            tamed[name] = rng.choice(values)
    tamed["stream"] = rng.random() < 0.5
    if not tamed["stream"]:
        tamed.pop("stream_options", None)
    if isinstance(tamed.get("stop"), list):
        tamed["stop"] = [stop for stop in tamed["stop"] if stop][:MAX_ITEMS]
    elif tamed.get("stop") == "":
        tamed.pop("stop")
    if isinstance(tamed.get("stop_token_ids"), list):
        tamed["stop_token_ids"] = [_token_id(i) for i in tamed["stop_token_ids"][:MAX_ITEMS]]
    if "prompt" in tamed:
        tamed["prompt"] = _tame_prompt(tamed["prompt"])
        if tamed.get("logprobs") is not None:
            tamed["logprobs"] = rng.choice(COMPLETION_LOGPROBS)
    if isinstance(tamed.get("messages"), list):
        tamed["messages"] = _tame_messages(tamed["messages"])
        if tamed.get("top_logprobs") is not None:
            tamed["logprobs"] = True
    return tamed


def _tame_tokenize(body: dict[str, Any]) -> dict[str, Any]:
    """One of prompt (text) or messages, with the options that go with it."""
    body.pop("tools", None)
    if isinstance(body.get("messages"), list):
        body.pop("prompt", None)
        body.pop("add_special_tokens", None)
        body["messages"] = _tame_messages(body["messages"])
        return body
    body.pop("messages", None)
    body.pop("add_generation_prompt", None)
    body["prompt"] = _text(body["prompt"]) if isinstance(body.get("prompt"), str) else FILLER
    return body


def _tame_prompt(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return _text(prompt)
    if not isinstance(prompt, list) or not prompt:
        return FILLER
    if all(isinstance(item, int) for item in prompt):  # one prompt, as token ids
        return [_token_id(item) for item in prompt[:MAX_TEXT_CHARS]]
    return [_tame_prompt(item) for item in prompt[:MAX_ITEMS]]


def _tame_messages(messages: list[Any]) -> list[Any]:
    # The tiny model's chat template, like many, refuses a conversation opened by the assistant.
    while messages and isinstance(messages[0], dict) and messages[0].get("role") == "assistant":
        messages = messages[1:]
    tamed = []
    for message in messages[:MAX_ITEMS]:
        if isinstance(message, dict):
            # A tool call's arguments must be JSON text, which the document cannot say.
            message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
            if message.get("content") is None:
                message["content"] = FILLER
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message = {**message, "content": _text(message["content"])}
        elif isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = message["content"][:MAX_ITEMS]
            message = {**message, "content": [_tame_part(part) for part in parts]}
        tamed.append(message)
    return tamed or [{"role": "user", "content": FILLER}]


def _tame_part(part: Any) -> Any:
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        return {**part, "text": _text(part["text"])}
    return part


def _text(text: str) -> str:
    return text[:MAX_TEXT_CHARS] or FILLER


def _token_id(value: Any) -> Any:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return value % NUM_SAFE_TOKEN_IDS if is_int else value
