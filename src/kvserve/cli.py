"""The ``kvserve`` command.

Each subcommand lives in its own module with a ``register(subparsers)``
function that adds its parser and sets ``run`` (``args -> exit code``) as a
default; adding a subcommand is one module and one entry in ``COMMANDS``.
The command sits on the top floor, beside the benchmarks and demos whose
command lines it gathers: nothing in kvserve imports it.

Bad values (an out-of-range flag, an unknown model) print ``error: <param>:
<message>`` and exit with code 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvserve import __version__
from kvserve.benchmarks import cli as bench
from kvserve.dashboard import cli as dashboard
from kvserve.demos import cli as demo
from kvserve.entrypoints import chat, generate
from kvserve.entrypoints.openai import cli_serve
from kvserve.errors import InvalidParameterError
from kvserve.trace import cli as trace

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

Subparsers = Any  # argparse's _SubParsersAction, which has no public name
COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    generate.register,
    chat.register,
    cli_serve.register,
    bench.register,
    trace.register,
    demo.register,
    dashboard.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: a small paged-KV LLM inference engine."
    )
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        exit_code: int = args.run(args)
    except InvalidParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
