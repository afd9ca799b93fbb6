"""This process's memory mappings as Linux's /proc/self/smaps lists them, for tests of where
weights live (a file's pages, anonymous memory, huge pages) and what stays resident."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

SMAPS = Path("/proc/self/smaps")
linux_only = pytest.mark.skipif(not SMAPS.exists(), reason="Linux's /proc only")


@dataclass
class Mapping:
    low: int
    high: int
    path: str  # empty for anonymous memory
    rss_kib: int = 0
    flags: set[str] = field(default_factory=set)  # VmFlags: "hg" is MADV_HUGEPAGE


def mappings() -> list[Mapping]:
    """Every mapping of this process, in address order."""
    found: list[Mapping] = []
    with open(SMAPS, encoding="ascii", errors="replace") as smaps:
        for line in smaps:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(v, 16) for v in head.split("-"))
                fields = line.split(maxsplit=5)
                found.append(Mapping(low, high, fields[5].strip() if len(fields) > 5 else ""))
            elif found and line.startswith("Rss:"):
                found[-1].rss_kib = int(line.split()[1])
            elif found and line.startswith("VmFlags:"):
                found[-1].flags = set(line.split()[1:])
    return found


def mapping_of(address: int) -> Mapping:
    """The mapping that holds ``address``."""
    for mapping in mappings():
        if mapping.low <= address < mapping.high:
            return mapping
    raise AssertionError(f"{address:#x} is not mapped")


def resident_file_bytes(path: Path) -> int:
    """This process's resident bytes of every mapping of the file ``path``."""
    return sum(m.rss_kib for m in mappings() if m.path.endswith(str(path))) * 1024
