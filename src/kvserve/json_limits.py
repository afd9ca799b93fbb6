"""JSON text from clients, parsed with its nesting bounded.

``json.loads`` recurses once per level: text nested a few thousand levels
deep (``[[[[...]]]]``, 2 bytes a level) raises RecursionError, which no caller
expects, and even a structure a little less deep makes every later walk of it
(``json.dumps``, a Jinja template, a schema compiler) recurse as deep.
:func:`loads_bounded` measures the text's depth first, without recursion, and
refuses anything deeper than asked with :class:`JsonTooDeepError`, a
``ValueError`` like every other reason the text is not acceptable JSON.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

# Deeper than any tool call's arguments or schema a person writes; far below the
# interpreter's recursion limit (1,000), whatever walks the value later.
MAX_JSON_DEPTH = 64

# A string, escapes included (an unterminated one runs to the end); and what is not a bracket.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# Each bracket's step in depth, indexed by its byte.
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


class JsonTooDeepError(ValueError):
    """JSON text nested deeper than allowed."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"it is nested more than {max_depth} levels deep, the most allowed")
        self.max_depth = max_depth


def nested_deeper_than(text: str, max_depth: int) -> bool:
    """Whether ``text``'s arrays and objects nest more than ``max_depth`` deep.

    Counted without parsing or recursion; brackets inside strings do not count.
    Text that is not JSON gets an answer too: it is for a parser to refuse it.
    """
    if text.count("[") + text.count("{") <= max_depth:
        return False  # not even that many brackets in all
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode()
    # The running sum of the steps is the depth at each bracket (in valid JSON, which
    # never closes more than it opened; invalid text fails to parse before it matters).
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > max_depth


def loads_bounded(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, refusing text nested deeper than ``max_depth`` (JsonTooDeepError)."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode()
    if nested_deeper_than(text, max_depth):
        raise JsonTooDeepError(max_depth)
    try:
        return json.loads(text)
    except RecursionError:  # a max_depth above what the interpreter allows
        raise JsonTooDeepError(max_depth) from None
