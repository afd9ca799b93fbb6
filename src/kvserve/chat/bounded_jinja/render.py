"""Compile a template and render it under :class:`TemplateLimits`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jinja2

from kvserve.chat.bounded_jinja.budget import ITEM_SIZE, RenderBudget, activated
from kvserve.chat.bounded_jinja.environment import BoundedEnvironment
from kvserve.chat.bounded_jinja.limits import TemplateLimitError, TemplateLimits


def render_template(source: str, variables: Mapping[str, Any], limits: TemplateLimits) -> str:
    """``source`` rendered with ``variables``, within ``limits``.

    The variables are copied in as plain JSON data (dicts, lists, strings,
    numbers; anything else becomes a ``<TypeName>`` placeholder), so the
    template reaches no object's methods but those of these types. Raises
    :class:`TemplateLimitError` past a limit, and whatever the template
    raises otherwise (``jinja2.TemplateError``, ``TypeError``, ...).
    """
    template = compile_template(source, limits)
    budget = RenderBudget(limits)
    with activated(budget):
        plain = {name: _copied_in(value, budget)[0] for name, value in variables.items()}
        chunks = []
        for chunk in template.generate(**plain):
            budget.wrote(len(chunk))
            chunks.append(chunk)
    return "".join(chunks)


def compile_template(source: str, limits: TemplateLimits) -> jinja2.Template:
    """``source`` compiled in the bounded environment (cached); too long a source is refused."""
    if len(source) > limits.max_template_chars:
        raise TemplateLimitError(
            "template_chars",
            f"a template of {len(source)} characters, more than {limits.max_template_chars}",
        )
    compiled = _compiled(source)
    if isinstance(compiled, Exception):
        raise compiled.with_traceback(None)  # a fresh traceback each time, not a growing one
    return compiled


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template | Exception:
    # A template that does not compile is remembered as such: compiling a long
    # one takes a second or two, and requests must not pay it again each time.
    try:
        return _environment().from_string(source)
    except Exception as exc:  # TemplateSyntaxError, RecursionError on deep nesting, ...
        return exc.with_traceback(None)


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedEnvironment:
    return BoundedEnvironment()


def _copied_in(value: Any, budget: RenderBudget) -> tuple[Any, int]:
    """A plain copy of ``value`` and its size; each container's size is told to the budget."""
    if value is None or type(value) in (str, int, float, bool):
        return value, len(value) if isinstance(value, str) else 1
    if isinstance(value, str):  # a subclass (an enum, ...) may carry methods: keep the text only
        text = str.__str__(value)
        return text, len(text)
    if isinstance(value, bool):
        return bool(value), 1
    if isinstance(value, int):
        return int.__int__(value), 1
    if isinstance(value, float):
        return float.__float__(value), 1
    copy: Any
    if isinstance(value, Mapping):
        pairs = [(_copied_in(k, budget), _copied_in(v, budget)) for k, v in value.items()]
        copy = {key: item for (key, _), (item, _) in pairs}
        size = 1 + sum(k + v + 2 * ITEM_SIZE for (_, k), (_, v) in pairs)
    elif isinstance(value, (list, tuple)):
        items = [_copied_in(item, budget) for item in value]
        copy = [item for item, _ in items]
        if isinstance(value, tuple):
            copy = tuple(copy)
        size = 1 + sum(item_size + ITEM_SIZE for _, item_size in items)
    else:
        placeholder = f"<{type(value).__name__}>"
        return placeholder, len(placeholder)
    budget.known(copy, size)
    return copy, size
