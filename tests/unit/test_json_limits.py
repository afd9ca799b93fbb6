"""JSON text from clients is parsed only when its nesting is bounded."""

from __future__ import annotations

import json

import pytest

from kvserve.json_limits import MAX_JSON_DEPTH, JsonTooDeepError, loads_bounded, nested_deeper_than


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("text", "depth", "deeper"),
    [
        ("1", 0, False),
        ('"a"', 0, False),
        (nested(3), 3, False),
        (nested(4), 3, True),
        ('{"a": {"b": [1, {"c": 2}]}}', 4, False),
        ('{"a": {"b": [1, {"c": 2}]}}', 3, True),
        ('["[[[[[[[[", "{{{{{{{{"]', 1, False),  # brackets in strings do not count
        (r'["\"[[[[[[[[", 1]', 1, False),  # nor after an escaped quote
        (r'["\\", [[1]]]', 2, True),  # an escaped backslash ends before the quote
        ("[1, 2, 3] [4] [5]", 1, False),  # siblings do not add up
    ],
)
def test_nesting_is_measured_without_parsing(text: str, depth: int, deeper: bool) -> None:
    assert nested_deeper_than(text, depth) is deeper


def test_text_nested_deeper_than_allowed_is_refused_before_parsing() -> None:
    # 5,000 levels made json.loads raise RecursionError, which no caller caught.
    for text in (nested(5000), '{"a":' * 5000 + "1" + "}" * 5000):
        with pytest.raises(JsonTooDeepError) as error:
            loads_bounded(text)
        assert isinstance(error.value, ValueError)  # callers' "not JSON" paths take it
        assert str(MAX_JSON_DEPTH) in str(error.value)
    assert loads_bounded(nested(MAX_JSON_DEPTH)) == json.loads(nested(MAX_JSON_DEPTH))
    assert loads_bounded(b'{"a": [1, "]]]]"]}', max_depth=2) == {"a": [1, "]]]]"]}


def test_broken_json_is_still_a_value_error() -> None:
    with pytest.raises(ValueError):
        loads_bounded('{"a": ')
