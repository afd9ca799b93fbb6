"""Weights the decode streams, held on transparent huge pages.

A decode step of one stream reads every weight once, so at batch 1 a large
model runs at the speed memory hands its weights to the cores. Where those
weights sit decides part of that speed: read through 4 KiB pages (a mapped
file, or memory PyTorch allocated), every page costs a TLB entry and the
cores' prefetchers stop at each page's end; read through 2 MiB pages they
stream on. Measured on a Zen 4 EPYC, two threads, a 1.05 GB Q4_K_M file:
a plain read of the mapped cache file 44-48 GB/s, of a private 4 KiB copy
41-46, of a private copy on huge pages 53-62; one pass of the quantized
kernels over its weights 0.87-0.93x the time (docs/benchmarks.md).

So once the layers hold the weights their kernels read, the plan copies every
large one into a single private anonymous mapping advised ``MADV_HUGEPAGE``
(Linux's transparent huge pages, in their ``always`` or ``madvise`` mode) and
takes the source's file pages out of the resident set. The costs: the copy is
private memory, so two processes serving one file hold one each (the mapped
cache file's pages were shared), and a load copies the weights once.
``KVSERVE_HUGE_PAGES=0`` keeps the weights where the load put them.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve.errors import InvalidParameterError
from kvserve.kernels.file_pages import drop_file_pages

HUGE_PAGES_ENV = "KVSERVE_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20
# Each copy starts on a cache line (the kernels' vector loads need no more).
_ALIGN = 64
_PIECE_BYTES = 16 << 20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or
    None where there is none to read (not Linux, or a kernel without them)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = _THP_SETTING.read_text(encoding="ascii")
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_wanted() -> bool:
    """Whether to move weights onto huge pages: ``KVSERVE_HUGE_PAGES`` (``auto``, the
    default: wherever the kernel gives them to a mapping that asks; ``0``: never)."""
    setting = os.environ.get(HUGE_PAGES_ENV, "").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return False
    if setting not in ("", "auto", "1", "on", "true", "yes"):
        raise InvalidParameterError(
            HUGE_PAGES_ENV, f"{setting!r} is not a setting; allowed: auto (the default), 1 or 0"
        )
    return transparent_huge_pages() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def to_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (contiguous, on the CPU), in order, packed into one private
    anonymous mapping whose 2 MiB-aligned range is advised ``MADV_HUGEPAGE`` before a
    page of it is touched. Where a source is a view of a mapped file, its pages leave
    the resident set as they are copied (:func:`drop_file_pages`). The mapping lives as
    long as any of the copies."""
    if not tensors:
        return []
    offsets, total = [], 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only contiguous CPU tensors move onto huge pages")
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    size = -(-total // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # One huge page more than the copies need, so that they can start on a huge page.
    mapping = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    memory = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    start = -memory.data_ptr() % HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    copies = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        at = start + offset
        source = tensor.reshape(-1).view(torch.uint8)
        # In pieces, each source piece's file pages dropped once copied: a large table
        # (Gemma 3's 170 MiB embedding) is never resident twice in full.
        for piece in range(0, nbytes, _PIECE_BYTES):
            end = min(piece + _PIECE_BYTES, nbytes)
            memory[at + piece : at + end].copy_(source[piece:end])
            drop_file_pages(source[piece:end])
        copies.append(memory[at : at + nbytes].view(tensor.dtype).view(tensor.shape))
    return copies
