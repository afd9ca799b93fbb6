"""Give the C heap's free pages back to the system once the engine is built.

Loading leaves large freed allocations behind: parsing a tokenizer's JSON
(Gemma 3's is 33 MB, parsed into several times that), the weight loader's
temporaries. glibc keeps freed memory for reuse, so it stays resident and
counts against the server's footprint for as long as it runs; ``malloc_trim``
returns what is free. Elsewhere (another C library, no glibc) this does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
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
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
