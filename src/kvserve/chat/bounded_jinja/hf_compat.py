"""What chat templates expect of their environment, as transformers provides it.

Chat templates are written for transformers' ``apply_chat_template``: its
``raise_exception``, ``strftime_now``, ``namespace`` and ``dict`` globals,
its ``tojson`` (no HTML escaping, with ``indent``, ``separators`` and
``sort_keys``), the ``loopcontrols`` extension and the ``{% generation %}``
tag, with blocks trimmed. Rendering them the same way here gives the same
text; ``tojson`` and ``strftime_now`` are sized first like the other
operations that can build more than they are given.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.utils import Namespace

from kvserve.chat.bounded_jinja.budget import active
from kvserve.chat.bounded_jinja.limits import UNITS_PER_STEP, TemplateLimitError

# json builds its indentation as ' ' * indent, then repeats it per nesting level.
_MAX_TOJSON_INDENT = 64
# No strftime directive writes more than this many characters per character of format.
_STRFTIME_GROWTH = 32


class GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text for
    training masks; rendering only needs its body."""

    tags = {"generation"}  # noqa: RUF012  (Jinja reads it from the class)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message: Any) -> None:
    raise jinja2.TemplateError(message)


def strftime_now(format: str) -> str:
    active().require_size(len(str(format)) * _STRFTIME_GROWTH, "strftime_now")
    return datetime.now().strftime(format)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON text of ``value``, stopped as soon as it is past the size limit."""
    budget = active()
    # The C encoder goes through the value at a copy's speed; with an indent, the
    # Python one takes about a microsecond for each item.
    budget.step(budget.size_of(value) * (64 if indent else 1) // UNITS_PER_STEP)
    width = len(indent) if isinstance(indent, str) else indent or 0
    if width > _MAX_TOJSON_INDENT:
        raise TemplateLimitError(
            "chars", f"tojson's indent of {width} (at most {_MAX_TOJSON_INDENT})"
        )
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    pieces: list[str] = []
    size = 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        budget.require_size(size, "tojson's text")
        pieces.append(piece)
    return "".join(pieces)


class TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)``, without the type itself to reach through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    """A namespace that refuses underscore names (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _check_name(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
        )


def install(environment: jinja2.Environment) -> None:
    """Give ``environment`` transformers' chat-template globals and filters."""
    environment.filters["tojson"] = tojson
    environment.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
