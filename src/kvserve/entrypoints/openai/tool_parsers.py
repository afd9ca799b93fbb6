"""Tool calls in a model's free text (``tool_choice="auto"``): one parser per format.

:data:`TOOL_PARSERS` maps a format's name to its parser. ``hermes`` reads the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks that
Hermes-style templates (Qwen2.5, SmolLM2's tool prompt, ...) teach; ``json``
reads an answer that is nothing but a call object or a list of them. A block
that does not parse, or names a function the request did not offer, stays
text. :class:`StreamingToolParser` does the same over a stream of text pieces:
text outside blocks goes out as it comes, each block as one tool-call delta
once it closes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.openai.protocol_tools import FunctionCall, ToolCall
from kvserve.json_limits import loads_bounded

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def new_tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments)
    )


def call_from_json(text: str, names: Collection[str]) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments": {...}}`` (or "parameters"), if that is what it is."""
    try:
        value = loads_bounded(text)
    except ValueError:
        return None
    return _call_from_value(value, names)


def _call_from_value(value: Any, names: Collection[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_tool_call(value["name"], json.dumps(arguments))


def parse_hermes(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text outside tool-call blocks, or None if empty; the calls), from a whole answer."""
    calls: list[ToolCall] = []
    content: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = call_from_json(match.group(1).strip(), names)
        content.append(text[position : match.start()] if call else text[position : match.end()])
        position = match.end()
        if call is not None:
            calls.append(call)
    content.append(text[position:])
    remaining = "".join(content).strip() if calls else text
    return (remaining or None), calls


def parse_json(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """An answer that is one call object, or a list of them; anything else is text."""
    try:
        value = loads_bounded(text)
    except ValueError:
        return text, []
    values = value if isinstance(value, list) else [value]
    calls = [_call_from_value(item, names) for item in values]
    if not calls or any(call is None for call in calls):
        return text, []
    return None, [call for call in calls if call is not None]


ToolParser = Callable[[str, Collection[str]], tuple[str | None, list[ToolCall]]]
TOOL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "json": parse_json}


@dataclass
class StreamingToolParser:
    """Hermes blocks in streamed text: :meth:`feed` each piece, :meth:`finish` at the end.

    Both return (text to send now, calls completed now). Text that could be the
    start of ``<tool_call>`` is held back until it is clearly not.
    """

    names: Collection[str]
    _buffer: str = ""
    _in_block: bool = False
    num_calls: int = 0

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self._buffer += piece
        text, calls = "", []
        while True:
            if self._in_block:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_block = False
                call = call_from_json(body.strip(), self.names)
                if call is None:
                    text += OPEN + body + CLOSE
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                text += self._buffer[:start]
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = _partial_suffix(self._buffer, OPEN)
            text += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        self.num_calls += len(calls)
        return text, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Whatever is held back: an unclosed block's call if it parses, else its text."""
        rest, self._buffer = self._buffer, ""
        if self._in_block:
            call = call_from_json(rest.strip(), self.names)
            if call is not None:
                self.num_calls += 1
                return "", [call]
            return OPEN + rest, []
        return rest, []


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for length in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-length:]):
            return length
    return 0
