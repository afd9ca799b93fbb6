"""Give the C heap's free pages back to the system: once the engine is built, and as it runs.

Loading leaves large freed allocations behind: parsing a tokenizer's JSON
(Gemma 3's is 33 MB, parsed into several times that), the weight loader's
temporaries. Serving does too: each step's short-lived buffers are freed
below longer-lived ones, so the heap's top cannot shrink. glibc keeps freed
memory for reuse, so it stays resident and counts against the server's
footprint for as long as it runs; ``malloc_trim`` returns what is free
(jemalloc does the same on a timer; glibc only when asked).
:class:`HeapReleaser` asks at most once a second while the engine is busy
and once when it goes idle: a call takes about a millisecond on a small
model's heap. Elsewhere (another C library, no glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import time
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def release_free_heap() -> bool:
    """Collect Python's garbage, then return the heap's free pages; False where unsupported."""
    gc.collect()
    return trim_heap()


def trim_heap() -> bool:
    """Return the C heap's free pages (no garbage collection first); False where unsupported."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapReleaser:
    """Trims the heap at most every ``interval_s`` while busy, and once on going idle.

    The engine loop calls :meth:`after_iteration` after each iteration; a
    trim is cheap (no garbage collection) but not free, so a busy loop pays
    for one a second at most.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.num_trims = 0
        self._last = time.monotonic()
        self._dirty = False  # work since the last trim

    def after_iteration(self, busy: bool) -> None:
        """``busy``: the loop has more work now; False right before it waits."""
        if busy:
            self._dirty = True
            if time.monotonic() - self._last < self.interval_s:
                return
        elif not self._dirty:
            return
        trim_heap()
        self.num_trims += 1
        self._dirty = False
        self._last = time.monotonic()
