"""``kvserve demo NAME``: run one demo (or ``all``), print its tables, and with ``--out``
write ``NAME.json`` and ``NAME.png``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvserve.config import ModelConfig
from kvserve.demos.context import DemoContext
from kvserve.demos.registry import demo_names, get_demo, run_demo
from kvserve.errors import InvalidParameterError

ALL = "all"


def register(subparsers: Any) -> None:
    names = ", ".join(demo_names())
    parser = subparsers.add_parser(
        "demo",
        help=f"demos that show why the engine is built this way ({names})",
        description=(
            "Run a demo on a real model, print its tables and, with --out, write its numbers "
            f"(NAME.json) and plot (NAME.png). Demos: {names}; 'all' runs every one."
        ),
    )
    parser.add_argument("name", metavar="NAME", help=f"one of: {names}, {ALL}")
    parser.add_argument("--model", default=ModelConfig.model, help="model path, alias or hub id")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="weight precision"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the engine and the workloads")
    parser.add_argument("--out", type=Path, help="write NAME.json and NAME.png into this folder")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    names = demo_names() if args.name == ALL else (args.name,)
    for name in names:
        get_demo(name)  # an unknown name fails before any model loads
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidParameterError("out", f"cannot be used as a folder: {exc}") from exc
    ctx = DemoContext(model=args.model, dtype=args.dtype, seed=args.seed, verbose=True)
    for name in names:
        ctx.progress(f"running demo {name} on {ctx.model} ...")
        result = run_demo(name, ctx)
        print(result.text(), end="\n\n", flush=True)
        if args.out is not None:
            written = result.write(args.out)
            print(f"wrote {written.json_path} and {written.png_path}\n", flush=True)
    return 0
