"""One render's budget: the steps taken, the text written, the clock, and value sizes.

The bounded environment (``environment.py``) calls into the budget of the
render in progress at every point where a template does work: each loop
iteration, call, filter, operator and concatenation takes a step; each
value such an operation builds is measured and charged; each piece of text
written is counted. The first thing past a limit raises
:class:`TemplateLimitError` inside the render, so the work stops there, in
the thread that renders: no thread is left running and nothing is killed.

The size of a value is what its text would roughly hold: a string's length,
and for a list, tuple, dict or namespace :data:`ITEM_SIZE` per item (its
quotes and separator) plus the sizes of the items, shared items counted each
time they occur (``[a, a]`` is twice ``a``, as its text is): a structure that
nests its way to an exponential size is refused as soon as it passes the
limit, before anything prints, compares or copies it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from contextvars import ContextVar
from typing import Any

from jinja2.utils import Namespace

from kvserve.chat.bounded_jinja.limits import (
    MAX_INT_BITS,
    UNITS_PER_STEP,
    TemplateLimitError,
    TemplateLimits,
)

# What an item adds to its container's text besides its own: quotes, ", ".
ITEM_SIZE = 4
# The clock is read every few steps: a step takes microseconds (or up to a few
# milliseconds for one that copies a value near the size limit).
_STEPS_PER_CLOCK_CHECK = 16

_ACTIVE: ContextVar[RenderBudget | None] = ContextVar("kvserve_render_budget", default=None)


class RenderBudget:
    """What one render has used of its :class:`TemplateLimits`."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.chars_written = 0
        self._deadline = time.monotonic() + limits.max_seconds
        self._next_clock_check = 0
        # id -> size of the containers the render was given: measured once, when
        # they were copied in (render.py); they live as long as the render.
        self._known_sizes: dict[int, int] = {}
        self._walked = 0  # values visited by size_of, charged a step per UNITS_PER_STEP

    def step(self, count: int = 1) -> None:
        """Take ``count`` steps; past the step limit or the deadline, stop the render."""
        self.steps += count
        if self.steps > self.limits.max_steps:
            raise TemplateLimitError(
                "steps",
                f"more than {self.limits.max_steps} steps of work (loop iterations, calls, "
                f"lookups, operators, and one per {UNITS_PER_STEP} characters they build)",
            )
        if self.steps >= self._next_clock_check:
            self._next_clock_check = self.steps + _STEPS_PER_CLOCK_CHECK
            if time.monotonic() > self._deadline:
                raise TemplateLimitError("seconds", f"more than {self.limits.max_seconds:g} s")

    def wrote(self, num_chars: int) -> None:
        """Count text the template wrote: its output, or a macro's or block's text."""
        self.chars_written += num_chars
        if self.chars_written > self.limits.max_chars:
            raise TemplateLimitError(
                "chars", f"more than {self.limits.max_chars} characters of text written"
            )

    def require_size(self, size: int, what: str) -> None:
        """Refuse, before it is built, a value of ``size`` characters or items."""
        if size > self.limits.max_chars:
            raise TemplateLimitError(
                "chars",
                f"{what} would hold {size} characters or items, more than {self.limits.max_chars}",
            )

    def require_int_bits(self, bits: int, what: str) -> None:
        """Refuse, before it is computed, an integer of ``bits`` bits."""
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(
                "chars", f"{what} would be an integer of {bits} bits, more than {MAX_INT_BITS}"
            )

    def built(self, value: Any, what: str = "a value") -> Any:
        """``value``, once measured against the size limit and its size charged in steps."""
        if isinstance(value, (str, bytes)):
            size = len(value)
        elif isinstance(value, int):
            self.require_int_bits(value.bit_length(), what)
            return value
        else:
            size = self.size_of(value)
        self.require_size(size, what)
        self.step(size // UNITS_PER_STEP)
        return value

    def known(self, value: Any, size: int) -> None:
        """Remember the size of an input container, so it is never walked again."""
        self._known_sizes[id(value)] = size

    def size_of(self, value: Any) -> int:
        """``value``'s size (see the module's docstring), or just past the limit.

        Each container is measured once per call however often it occurs, so
        ``[a, a]`` nested forty deep costs forty measurements, not 2**40; one
        that holds itself (a namespace can) is past any limit.
        """
        walked_before = self._walked
        size = self._measure(value, {}, set())
        self.step((self._walked - walked_before) // UNITS_PER_STEP)
        return size

    def _measure(self, value: Any, measured: dict[int, int], open_ids: set[int]) -> int:
        if isinstance(value, (str, bytes, range)):
            return len(value)
        key = id(value)
        size = self._known_sizes.get(key, measured.get(key))
        if size is not None:
            return size
        children = _children(value)
        if children is None:
            return 1
        limit = self.limits.max_chars
        if key in open_ids:  # it holds itself
            return limit + 1
        if isinstance(children, (list, tuple)) and len(children) * ITEM_SIZE > limit:
            return limit + 1  # too many items, whatever they hold: no need to go through them
        open_ids.add(key)
        size = 1
        for child in children:
            self._walked += 1
            # Most items are strings or numbers: sized here, without a call.
            if isinstance(child, (str, bytes)):
                size += len(child) + ITEM_SIZE
            elif child is None or isinstance(child, (int, float)):
                size += 1 + ITEM_SIZE
            else:
                size += self._measure(child, measured, open_ids) + ITEM_SIZE
            if size > limit:
                break
        open_ids.discard(key)
        measured[key] = size
        return size

    def counted(self, iterable: Iterable[Any]) -> CountedIterator:
        """``iterable``, taking a step per item: the items of a for loop."""
        return CountedIterator(iterable, self)


class CountedIterator:
    """An iterator that takes a step of the render's budget per item.

    It keeps its iterable's length (Jinja's ``loop.length`` asks for it).
    """

    __slots__ = ("_budget", "_iterable", "_iterator")

    def __init__(self, iterable: Iterable[Any], budget: RenderBudget) -> None:
        self._iterable = iterable
        self._iterator = iter(iterable)
        self._budget = budget

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self._budget.step()
        return next(self._iterator)

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # TypeError tells Jinja to count


def _children(value: Any) -> Iterable[Any] | None:
    """The values inside a container, or None for a leaf."""
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, (KeysView, ValuesView, ItemsView)):  # a dict's view holds what it holds
        return list(value)
    if isinstance(value, Namespace):
        attributes: dict[str, Any] = object.__getattribute__(value, "_Namespace__attrs")
        return [*attributes.values()]
    return None


@contextlib.contextmanager
def activated(budget: RenderBudget) -> Iterator[RenderBudget]:
    """Make ``budget`` the one the bounded environment charges, in this context only."""
    token = _ACTIVE.set(budget)
    try:
        yield budget
    finally:
        _ACTIVE.reset(token)


def active() -> RenderBudget:
    """The budget of the render in progress.

    Jinja folds constant expressions while compiling, outside any render; the
    error raised then makes it leave the expression to the render, where it is
    charged.
    """
    budget = _ACTIVE.get()
    if budget is None:
        raise RuntimeError("a bounded template operation outside a render")
    return budget
