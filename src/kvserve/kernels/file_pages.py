"""Drop a memory-mapped file's pages from this process's resident set once copied."""

from __future__ import annotations

import ctypes
import os
import sys

import torch

_MADV_DONTNEED = 4


def drop_file_pages(data: torch.Tensor) -> None:
    """Take the pages of ``data`` out of this process's resident set where it is a view of
    a memory-mapped file (a GGUF tensor that was just copied: repacked, or its q/k rows
    reordered for RoPE): the copy is what the kernels read from now on, and without
    this the pages read while copying would stay counted twice. The file's pages stay in the page cache; reading the view again
    maps them back. Anonymous memory is left alone (dropping it would lose the data)."""
    if not sys.platform.startswith("linux") or data.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(v, 16) for v in fields[0].split("-"))
                if low <= start < high:
                    if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/"):
                        return  # anonymous memory
                    break
            else:
                return
    except OSError:
        return
    first, last = -(-start // page) * page, end // page * page
    if last > first and end <= high:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
