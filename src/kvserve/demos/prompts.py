"""Prompts for the demos: chat conversations as token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvserve.chat.encode import encode_chat
from kvserve.engine import LLMEngine

Message = Mapping[str, str]


def chat_token_ids(engine: LLMEngine, messages: Sequence[Message]) -> list[int]:
    """The conversation through the model's chat template, ready for the answer.

    A model without a template (a base model, a test's tiny model) gets the
    messages as ``role: content`` lines followed by ``assistant:``.
    """
    tokenizer = engine.tokenizer
    if tokenizer.chat_template:
        return encode_chat(tokenizer, messages)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer.encode(text, add_special_tokens=False))
