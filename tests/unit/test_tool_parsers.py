"""Tool-call parsers: whole answers, and the same answers streamed in every split."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.tool_parsers import StreamingToolParser, parse_hermes, parse_json

NAMES = {"get_weather", "get_time"}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWERS = [
    ("plain text, no call", "plain text, no call", []),
    (f"Let me check.<tool_call>\n{CALL}\n</tool_call>", "Let me check.", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>{CALL}</tool_call><tool_call>" + '{"name": "get_time", "parameters": {}}</tool_call>', None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("<tool_call>{not json}</tool_call> tail", "<tool_call>{not json}</tool_call> tail", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    (f"<tool_call>{CALL}", None, [("get_weather", {"city": "Paris"})]),  # EOS before the close tag
    ("a < b <tool", "a < b <tool", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
def test_hermes_whole_answers(
    text: str, content: str | None, calls: list[tuple[str, dict]]
) -> None:
    got_content, got_calls = parse_hermes(text, NAMES)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_hermes_streamed_equals_whole(
    text: str, content: str | None, calls: list[tuple[str, dict]], piece: int
) -> None:
    parser = StreamingToolParser(NAMES)
    streamed_text, streamed_calls = "", []
    for start in range(0, len(text), piece):
        got_text, got_calls = parser.feed(text[start : start + piece])
        streamed_text += got_text
        streamed_calls += got_calls
    got_text, got_calls = parser.finish()
    streamed_text += got_text
    streamed_calls += got_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed_calls] == calls
    if not calls:
        assert streamed_text == text
    else:
        assert streamed_text.strip() == (content or "")


def test_json_parser_takes_only_whole_call_answers() -> None:
    assert parse_json("hello", NAMES) == ("hello", [])
    content, calls = parse_json(f"[{CALL}]", NAMES)
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    assert parse_json('{"name": "nope", "arguments": {}}', NAMES)[1] == []
