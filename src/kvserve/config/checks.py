"""The checks every config dataclass runs on construction.

Each raises :class:`~kvserve.errors.InvalidParameterError` naming the field, so
a bad value is refused before any engine state exists. They live apart from
the dataclasses because all of them (model, cache, scheduler, parallel, KV
events) share them.
"""

from __future__ import annotations

from kvserve.errors import InvalidParameterError


def require(condition: bool, param: str, message: str) -> None:
    """Raise InvalidParameterError(param, message) unless ``condition`` holds."""
    if not condition:
        raise InvalidParameterError(param, message)


def require_positive_int(value: object, param: str) -> None:
    """Refuse anything but an int >= 1 (a bool is refused too)."""
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        param,
        f"must be a positive integer, got {value!r}",
    )
