"""What a demo hands back: an explanation, tables, the numbers behind them and a plot.

A result is written as ``NAME.json`` (everything but the plot function) and
``NAME.png``; the docs generator reads the JSON back, so the page shows
exactly what the run printed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

Cell = str | int | float
# Draws the plot of a result's data into a PNG at the given path.
PlotFunction = Callable[[Mapping[str, Any], Path], None]


def format_cell(cell: Cell) -> str:
    """Floats with two decimals and thousands separators, integers with separators."""
    if isinstance(cell, bool):
        return "yes" if cell else "no"
    if isinstance(cell, float):
        return f"{cell:,.2f}" if math.isfinite(cell) else str(cell)
    if isinstance(cell, int):
        return f"{cell:,}"
    return cell


@dataclass(frozen=True)
class Table:
    """A titled table; cells stay numbers (JSON) and are formatted only when shown."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.title!r}: a row has {len(row)} cells for {len(self.columns)} columns"
                )

    @classmethod
    def build(cls, title: str, columns: Sequence[str], rows: Sequence[Sequence[Cell]]) -> Table:
        return cls(title, tuple(columns), tuple(tuple(row) for row in rows))

    def _cells(self) -> list[list[str]]:
        return [[format_cell(cell) for cell in row] for row in self.rows]

    def _numeric(self) -> list[bool]:
        """Per column: whether every cell is a number (shown aligned to the right)."""
        return [
            all(isinstance(row[i], (int, float)) for row in self.rows)
            for i in range(len(self.columns))
        ]

    def text(self) -> str:
        """Aligned plain text: numbers to the right, text to the left."""
        cells = self._cells()
        widths = [max(len(c) for c in column) for column in zip(self.columns, *cells, strict=True)]
        numeric = self._numeric()

        def line(values: Sequence[str]) -> str:
            return "  ".join(
                v.rjust(w) if right else v.ljust(w)
                for v, w, right in zip(values, widths, numeric, strict=True)
            ).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join([self.title, line(self.columns), rule, *map(line, cells)])

    def markdown(self) -> str:
        """A GitHub markdown table under a bold title."""
        cells = self._cells()
        align = ["---:" if right else ":---" for right in self._numeric()]
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |"]
        lines.append("| " + " | ".join(align) + " |")
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": [list(r) for r in self.rows],
        }

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Table:
        return cls.build(payload["title"], payload["columns"], payload["rows"])


class WrittenFiles(NamedTuple):
    json_path: Path
    png_path: Path


@dataclass(frozen=True)
class DemoResult:
    """One demo's outcome.

    name: the registry name (``static-vs-continuous``).
    title: a one-line heading.
    explanation: a paragraph: what the demo shows and why the engine is built this way.
    tables: what ``kvserve demo`` prints.
    data: the JSON-serialisable numbers behind the tables and the plot.
    plot: draws ``data`` into a PNG (the demo module's ``plot`` function).
    context: the settings it ran with (:meth:`DemoContext.describe`), filled by ``run_demo``.
    """

    name: str
    title: str
    explanation: str
    tables: tuple[Table, ...]
    data: Mapping[str, Any]
    plot: PlotFunction
    context: Mapping[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        """The heading and every table, as ``kvserve demo`` prints them."""
        heading = f"== {self.name}: {self.title}"
        return "\n\n".join([heading, *(table.text() for table in self.tables)])

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "explanation": self.explanation,
            "context": dict(self.context),
            "tables": [table.to_json() for table in self.tables],
            "data": dict(self.data),
        }

    def write(self, out_dir: Path) -> WrittenFiles:
        """Write ``out_dir/NAME.json`` and ``out_dir/NAME.png`` (the folder is created)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"{self.name}.json"
        png_path = out_dir / f"{self.name}.png"
        json_path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        self.plot(self.data, png_path)
        return WrittenFiles(json_path, png_path)
