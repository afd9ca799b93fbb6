"""A batch job's output folder: results keyed by row id, written so that reruns resume.

Each finished batch becomes one JSON Lines file, ``part-<digest>.jsonl``, one
object per row. The file appears whole or not at all: it is written under a
temporary name and renamed into place. Its name is a digest of the batch's
row ids, so a batch that is retried (its worker died after writing, before
reporting) rewrites the same file instead of adding a second copy. A rerun
reads the ids already present and computes only the other rows; every row
then ends up in exactly one file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

PART_GLOB = "part-*.jsonl"


def part_path(output_dir: str | Path, row_ids: Sequence[Any]) -> Path:
    """The file that holds the batch of these row ids (order does not matter)."""
    digest = hashlib.sha256(json.dumps(sorted(map(str, row_ids))).encode("utf-8")).hexdigest()
    return Path(output_dir) / f"part-{digest[:24]}.jsonl"


def write_part(output_dir: str | Path, rows: Sequence[Mapping[str, Any]], id_column: str) -> Path:
    """Write one batch's rows as a part file, atomically; returns its path."""
    path = part_path(output_dir, [row[id_column] for row in rows])
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    return path


def read_results(output_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Every row written to ``output_dir`` so far (none if it does not exist)."""
    for path in sorted(Path(output_dir).glob(PART_GLOB)):
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                yield json.loads(line)


def written_ids(output_dir: str | Path, id_column: str) -> set[Any]:
    """The row ids that already have a result in ``output_dir``."""
    return {row[id_column] for row in read_results(output_dir)}
