"""Resident memory of a server from outside: its process tree's, sampled, and its own peak.

``/proc/PID/status`` gives ``VmRSS`` (resident now) and ``VmHWM`` (the peak
resident size the kernel kept for that process). A server may start helper
processes (a compiler on first use, worker pools), so the benchmark also sums
``VmRSS`` over the server and all its descendants, sampled from a thread a
few times a second, and keeps the largest sum. Linux only.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import NamedTuple

_PROC = Path("/proc")


class ProcessMemory(NamedTuple):
    """One process's resident memory now and at its peak, in bytes."""

    rss_bytes: int
    hwm_bytes: int


def parse_status(status_text: str) -> ProcessMemory | None:
    """``VmRSS`` and ``VmHWM`` from the text of ``/proc/PID/status``; None when either is missing."""
    values: dict[str, int] = {}
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if (
            key in ("VmRSS", "VmHWM")
            and len(parts) == 2
            and parts[1] == "kB"
            and parts[0].isdigit()
        ):
            values[key] = int(parts[0]) * 1024
    if len(values) != 2:
        return None  # a kernel thread, a zombie, or not Linux
    return ProcessMemory(values["VmRSS"], values["VmHWM"])


def process_memory(pid: int) -> ProcessMemory | None:
    """Process ``pid``'s memory, or None when it has exited (or this is not Linux)."""
    try:
        return parse_status((_PROC / str(pid) / "status").read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError):
        return None


def parent_pid(stat_text: str) -> int | None:
    """The parent's id from ``/proc/PID/stat``; the name before it may hold spaces and ')'."""
    fields = stat_text.rpartition(")")[2].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it, as the ids are now."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = parent_pid((entry / "stat").read_text(encoding="ascii", errors="replace"))
        except OSError:
            continue  # exited while we looked
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [root], [root]
    while frontier:
        frontier = [child for pid in frontier for child in children.get(pid, [])]
        tree.extend(frontier)
    return tree


def tree_rss_bytes(root: int) -> int:
    """The resident memory of ``root`` and its descendants, summed."""
    total = 0
    for pid in process_tree(root):
        memory = process_memory(pid)
        total += memory.rss_bytes if memory is not None else 0
    return total


class TreePeakSampler:
    """Samples :func:`tree_rss_bytes` of ``root`` every ``interval_s`` in a thread, keeps the peak.

    Use as a context manager; ``peak_bytes`` holds the largest sum seen so far.
    """

    def __init__(self, root: int, interval_s: float = 0.1) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        while True:
            self.sample_now()
            if self._stop.wait(self.interval_s):
                return

    def sample_now(self) -> None:
        self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.root))
        self.num_samples += 1

    def __enter__(self) -> TreePeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
