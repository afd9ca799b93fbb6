"""release_free_heap returns freed C-heap pages to the system (glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from kvserve.kernels.heap import release_free_heap


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_freed_small_allocations_stop_being_resident() -> None:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None or not hasattr(ctypes.CDLL(libc_name), "malloc_trim"):
        pytest.skip("not glibc")
    libc = ctypes.CDLL(libc_name)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # Many small blocks live on the heap itself (not in their own mappings), like a
    # parser's temporaries. The last one stays: below it, freed pages are not at the
    # heap's top, so free() alone keeps them resident with the allocator.
    blocks = [libc.malloc(4000) for _ in range(40_000)]
    for block in blocks:
        ctypes.memset(block, 1, 4000)
    for block in blocks[:-1]:
        libc.free(block)
    freed = _rss_anon_kib()
    assert release_free_heap() is True
    trimmed = _rss_anon_kib()
    libc.free(blocks[-1])
    # About 156 MiB were written and freed; most of it must leave with the call.
    assert freed - trimmed > 100_000, (freed, trimmed)
