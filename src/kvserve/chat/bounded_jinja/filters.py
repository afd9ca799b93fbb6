"""Jinja's filters under a render's budget.

Every filter takes a step and has its result measured (``RenderBudget.built``).
The few that can build far more than they were given (a width, a count, a
separator repeated per item) are sized from their arguments first, and
``join`` and ``sum`` stop as soon as what they build is past the limit,
instead of after building it. The ones that do slow work per character or
item (regular expressions, Python loops, sorting) are charged for it before
they start, so one call cannot run for seconds past the clock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jinja2 import filters as jinja_filters
from jinja2.nodes import EvalContext
from jinja2.utils import pass_environment, pass_eval_context

from kvserve.chat.bounded_jinja.budget import active
from kvserve.chat.bounded_jinja.limits import UNITS_PER_STEP
from kvserve.chat.bounded_jinja.ops import (
    binop,
    charge_striptags,
    check_percent_format,
    gather,
    replaced_size,
)

Filter = Callable[..., Any]


# Steps per UNITS_PER_STEP characters or items of input, charged before the
# filter runs, for those whose work per character or item is far above a
# copy's: about a microsecond a step, as a loop iteration takes (urlize takes
# ~4 us a character; select and map call back into Python for each item).
_SLOW_FILTERS = {
    "urlize": 256,
    "title": 64,
    "wordwrap": 64,
    "urlencode": 64,
    "sort": 64,
    "dictsort": 64,
    "groupby": 64,
    "map": 64,
    "select": 64,
    "reject": 64,
    "selectattr": 64,
    "rejectattr": 64,
    "batch": 64,
    "unique": 32,
    "min": 32,
    "max": 32,
    "join": 32,
    "wordcount": 32,
}
# Charged for what they hold, not their length: they go through all of it.
_DEEP_FILTERS = {"pprint": 64}


def bounded_filters(filters: Mapping[str, Filter]) -> dict[str, Filter]:
    """``filters`` with the sized replacements below, each charged and measured."""
    return {name: _charged(name, f) for name, f in {**filters, **_SIZED}.items()}


def _charged(name: str, function: Filter) -> Filter:
    weight = _SLOW_FILTERS.get(name, 0)
    deep_weight = _DEEP_FILTERS.get(name, 0)
    # A filter marked pass_context/pass_environment/pass_eval_context gets that first.
    value_index = 0 if getattr(function, "jinja_pass_arg", None) is None else 1

    # functools.wraps keeps the pass_* mark Jinja reads.
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        budget = active()
        budget.step()
        if weight and len(args) > value_index:
            budget.step(_length(args[value_index]) * weight // UNITS_PER_STEP)
        elif deep_weight and len(args) > value_index:
            budget.step(budget.size_of(args[value_index]) * deep_weight // UNITS_PER_STEP)
        return budget.built(function(*args, **kwargs), f"the {name} filter's result")

    return run


def _length(value: Any) -> int:
    """Characters or items, where that is known without going through them."""
    try:
        return len(value)
    except TypeError:  # a generator: its items were charged as they were made
        return 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _center(value: Any, width: int = 80) -> str:
    active().require_size(_int(width), "the center filter")
    return jinja_filters.do_center(value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    text = str(s)
    unit = len(width) if isinstance(width, str) else _int(width)
    active().require_size(len(text) + (text.count("\n") + 2) * unit, "the indent filter")
    return jinja_filters.do_indent(s, width, first, blank)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    check_percent_format(active(), str(value), kwargs or args)
    return jinja_filters.do_format(value, *args, **kwargs)


@pass_eval_context
def _replace(eval_ctx: EvalContext, s: Any, old: Any, new: Any, count: int | None = None) -> str:
    size = replaced_size(str(s), str(old), str(new), -1 if count is None else count)
    active().require_size(size, "the replace filter")
    return jinja_filters.do_replace(eval_ctx, s, old, new, count)


@pass_environment
def _wordwrap(environment: Any, s: Any, width: int = 79, *args: Any, **kwargs: Any) -> str:
    wrapstring = kwargs.get("wrapstring", args[1] if len(args) > 1 else None)
    separator = environment.newline_sequence if wrapstring is None else str(wrapstring)
    # At worst a line per character, each ended by the separator.
    active().require_size(len(str(s)) * (1 + len(separator)), "the wordwrap filter")
    return jinja_filters.do_wordwrap(environment, s, width, *args, **kwargs)


def _batch(value: Iterable[Any], linecount: int, fill_with: Any = None) -> Any:
    active().require_size(_int(linecount), "the batch filter")
    return jinja_filters.do_batch(value, linecount, fill_with)


def _slice(value: Iterable[Any], slices: int, fill_with: Any = None) -> Any:
    active().require_size(_int(slices), "the slice filter")
    return jinja_filters.sync_do_slice(value, slices, fill_with)  # type: ignore[arg-type]


@pass_eval_context
def _join(eval_ctx: EvalContext, value: Iterable[Any], d: str = "", attribute: Any = None) -> str:
    if attribute is not None:
        value = map(jinja_filters.make_attrgetter(eval_ctx.environment, attribute), value)
    separator = str(d)
    return separator.join(gather(active(), (str(item) for item in value), separator))


@pass_environment
def _sum(environment: Any, iterable: Iterable[Any], attribute: Any = None, start: Any = 0) -> Any:
    if attribute is not None:
        iterable = map(jinja_filters.make_attrgetter(environment, attribute), iterable)
    total = start
    budget = active()
    for item in iterable:
        total = binop(budget, "+", total, item)  # each sum of lists or strings is sized
    return total


def _striptags(value: Any) -> str:
    text = str(value)
    charge_striptags(active(), text)
    return jinja_filters.do_striptags(value)


_SIZED: dict[str, Filter] = {
    "striptags": _striptags,
    "center": _center,
    "indent": _indent,
    "format": _format,
    "replace": _replace,
    "wordwrap": _wordwrap,
    "batch": _batch,
    "slice": _slice,
    "join": _join,
    "sum": _sum,
}
