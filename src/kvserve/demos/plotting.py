"""Figures for the demos: drawn with matplotlib's object API (no pyplot, no display).

``Figure`` objects render through the Agg canvas when saved, so plots work on
headless machines and leave no global state behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

# Small enough for docs (each PNG well under 150 KB), sharp enough to read.
_DPI = 100
MIB = 1024 * 1024


def new_figure(
    nrows: int = 1, ncols: int = 1, width: float = 9.0, height: float = 4.8, **subplot_kw: Any
) -> tuple[Figure, np.ndarray]:
    """A figure and its axes as a 2-D array ``[nrows, ncols]``."""
    figure = Figure(figsize=(width, height), layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return figure, axes


def save_png(figure: Figure, path: Path) -> None:
    figure.savefig(path, dpi=_DPI)
