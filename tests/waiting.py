"""A bounded wait for tests: poll a condition until it holds, or fail after a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    condition: Callable[[], object], timeout: float = 10.0, what: str = "the condition"
) -> None:
    """Return once ``condition()`` is true; fail the test, naming ``what``, after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)
