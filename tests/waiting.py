"""Bounded waits for tests: a condition polled, or a coroutine run, until a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], object], timeout: float = 10.0, what: str = "the condition"
) -> None:
    """Return once ``condition()`` is true; fail the test, naming ``what``, after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def run_with_deadline(coroutine: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """``asyncio.run`` that fails the test after ``timeout`` s: a stream that never ends."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout))
