"""release_free_heap returns freed C-heap pages to the system (glibc); the engine
loop's HeapReleaser asks for it at most once an interval while busy."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from kvserve.kernels import heap
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


def test_the_loop_trims_at_most_once_an_interval_while_busy_and_once_going_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    trims: list[float] = []
    monkeypatch.setattr(heap.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(clock[0]) or True)
    releaser = heap.HeapReleaser(interval_s=1.0)
    releaser.after_iteration(False)  # idle from the start: nothing to give back
    assert trims == []
    for _ in range(25):  # 2.5 s of busy iterations, 0.1 s apart
        clock[0] += 0.1
        releaser.after_iteration(True)
    assert len(trims) == 2 and trims[1] - trims[0] >= 1.0
    clock[0] += 0.1
    releaser.after_iteration(False)  # going idle trims once, whatever the interval
    releaser.after_iteration(False)
    assert len(trims) == 3 and releaser.num_trims == 3
