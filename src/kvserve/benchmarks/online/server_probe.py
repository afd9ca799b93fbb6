"""What a benchmark reads about a running server from outside: its metrics and its memory.

``kvserve bench soak`` (and the API fuzzer in ``tests/fuzz``) check that a
server under hostile load gives back everything it took: every KV block
free (``kvserve_kv_cache_blocks_used`` on ``/metrics``) and resident memory
that does not keep growing (``VmRSS`` in ``/proc/PID/status``, Linux).
"""

from __future__ import annotations

import math
from pathlib import Path

# The gauges that say the engine holds nothing: KV blocks in use, sequences running or waiting.
BLOCKS_USED = "kvserve_kv_cache_blocks_used"
RUNNING = "kvserve_num_requests_running"
WAITING = "kvserve_num_requests_waiting"


def metric_value(text: str, name: str) -> float | None:
    """The value of metric ``name`` in Prometheus' text format, summed over its label sets.

    None when no sample of ``name`` is there (a different server, or an older kvserve).
    """
    total = None
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):  # another metric whose name starts like this one
            continue
        try:
            value = float(line.rsplit(maxsplit=1)[1])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            total = value if total is None else total + value
    return total


def parse_vm_rss(status_text: str) -> int | None:
    """Resident memory in bytes from the text of ``/proc/PID/status`` (``VmRSS:  1234 kB``)."""
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                return int(parts[0]) * 1024
    return None


def read_rss_bytes(pid: int) -> int | None:
    """Process ``pid``'s resident memory, or None when it has exited (or this is not Linux)."""
    try:
        return parse_vm_rss(Path(f"/proc/{pid}/status").read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError):
        return None
