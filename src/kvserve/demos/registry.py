"""The demos by name, in the order the docs present them.

To add a demo: write a module with ``TITLE`` and ``run(ctx: DemoContext) ->
DemoResult`` and add its name and module path to ``DEMOS``. Modules are
imported only when their demo runs, so listing the names costs nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Protocol, cast

from kvserve.demos.context import DemoContext
from kvserve.demos.result import DemoResult
from kvserve.errors import InvalidParameterError

DEMOS: dict[str, str] = {
    "static-vs-continuous": "kvserve.demos.static_vs_continuous",
    "waste": "kvserve.demos.waste",
    "kv-memory": "kvserve.demos.kv_memory",
    "block-table": "kvserve.demos.block_table",
    "schedule": "kvserve.demos.schedule",
    "prefix-cache": "kvserve.demos.prefix_cache",
}


class Demo(Protocol):
    """What a demo module provides."""

    TITLE: str

    def run(self, ctx: DemoContext) -> DemoResult: ...


def demo_names() -> tuple[str, ...]:
    return tuple(DEMOS)


def get_demo(name: str) -> Demo:
    """The module of demo ``name``; an unknown name raises, listing the known ones."""
    if name not in DEMOS:
        raise InvalidParameterError(
            "demo", f"unknown demo {name!r}; known: {', '.join(DEMOS)} (or 'all')"
        )
    return cast(Demo, importlib.import_module(DEMOS[name]))


def run_demo(name: str, ctx: DemoContext) -> DemoResult:
    """Run demo ``name`` under ``ctx``; the result records the settings and the machine it
    ran on, with the load average when it started (other work on the machine slows the
    timings, never the step counts)."""
    from kvserve.benchmarks.common import cpu_info

    load_average = os.getloadavg()[0]
    result = get_demo(name).run(ctx)
    context = {**ctx.describe(), "machine": cpu_info().describe(), "load_average": load_average}
    return dataclasses.replace(result, context=context)
