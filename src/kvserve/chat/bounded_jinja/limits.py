"""The limits a template renders under, their defaults, and their one override.

A chat template comes with the model file, and a model file may be hostile:
its template is untrusted code, run on every chat request. Jinja's sandbox
stops it from reaching Python's internals, but not from working for ever or
building a string of gigabytes. So each render gets a budget:

- ``max_steps``: the work. One step per loop iteration, call (function,
  method, macro, filter), attribute or item lookup, arithmetic operator and
  ``~`` concatenation, plus one per :data:`UNITS_PER_STEP` characters or
  items an operation builds (filters that do slow work per character are
  charged for their input before they start).
- ``max_chars``: the size of anything the template builds: its output, the
  text it writes into macros and ``{% set %}`` blocks on the way, and every
  string, list or dict it makes (a nested list counts all it holds).
- ``max_seconds``: the render's wall time, checked at every step.
- ``max_template_chars``: the template's own length, checked before it is
  compiled.

The defaults are far above what real templates use (see docs/security.md);
``KVSERVE_CHAT_TEMPLATE_LIMITS`` overrides any of them, as
``steps=2000000,chars=16777216,seconds=5,template_chars=262144``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace

from kvserve.errors import InvalidParameterError

LIMITS_ENV = "KVSERVE_CHAT_TEMPLATE_LIMITS"
# Characters or items an operation may build per step it is charged.
UNITS_PER_STEP = 64
# The largest integer a template may compute, in bits: its decimal form stays far
# below Python's 4,300-digit conversion limit, and its arithmetic is quick.
MAX_INT_BITS = 8192

# The names the override uses for each field.
_KEYS = {
    "steps": "max_steps",
    "chars": "max_chars",
    "seconds": "max_seconds",
    "template_chars": "max_template_chars",
}


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a template may use.

    max_steps: loop iterations, calls, lookups and operators, plus one step per
        64 characters or items built.
    max_chars: the most characters (or items) the output, any text the template
        writes on the way, or any value it builds may hold.
    max_seconds: the render's wall time.
    max_template_chars: the longest template that is compiled at all.
    """

    max_steps: int = 1_000_000
    max_chars: int = 4 * 1024 * 1024
    max_seconds: float = 2.0
    max_template_chars: int = 128 * 1024

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidParameterError(field.name, f"must be a positive number, got {value!r}")
            if field.name != "max_seconds" and not isinstance(value, int):
                raise InvalidParameterError(field.name, f"must be an integer, got {value!r}")


class TemplateLimitError(Exception):
    """A render went past one of its :class:`TemplateLimits`.

    ``limit`` is the field's override key (``steps``, ``chars``, ``seconds``,
    ``template_chars``); the message says what went past it.
    """

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def limits_from_env() -> TemplateLimits:
    """The defaults, with the overrides of ``$KVSERVE_CHAT_TEMPLATE_LIMITS`` applied."""
    return parse_limits(os.environ.get(LIMITS_ENV, ""))


@functools.lru_cache(maxsize=8)
def parse_limits(text: str) -> TemplateLimits:
    """``"steps=2000000,seconds=5"`` → the defaults with those two replaced."""
    overrides: dict[str, int | float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        field = _KEYS.get(key.strip())
        if field is None:
            raise InvalidParameterError(
                LIMITS_ENV, f"unknown limit {key.strip()!r}; known: {', '.join(_KEYS)}"
            )
        try:
            overrides[field] = float(value) if key.strip() == "seconds" else int(value)
        except ValueError:
            raise InvalidParameterError(LIMITS_ENV, f"{item!r} is not a number") from None
    return replace(TemplateLimits(), **overrides)  # type: ignore[arg-type]
