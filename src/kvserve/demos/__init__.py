"""``kvserve demo NAME``: small experiments on a real model that show why the engine is built this way.

Each demo is a module with ``run(ctx: DemoContext) -> DemoResult``, listed by
name in :mod:`kvserve.demos.registry`. A result holds a short explanation,
tables, the numbers behind them (JSON) and a plot; ``kvserve demo all --out
DIR`` writes them all, and ``make docs`` turns them into ``docs/demos.md``.
"""

from __future__ import annotations

from kvserve.demos.context import DemoContext
from kvserve.demos.registry import demo_names, run_demo
from kvserve.demos.result import DemoResult, Table

__all__ = ["DemoContext", "DemoResult", "Table", "demo_names", "run_demo"]
