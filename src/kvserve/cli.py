"""The ``kvserve`` command.

Each subcommand lives in its own module with a ``register(subparsers)``
function that adds its parser and sets ``run`` (``args -> exit code``) as a
default; adding a subcommand is one module and one entry in ``COMMANDS``.
The command sits on the top floor, beside the benchmarks and demos whose
command lines it gathers: nothing in kvserve imports it.

A command line that names its subcommand imports only that subcommand's
module: the benchmarks pull in HTTP clients and terminal renderers a server
never uses, and whatever a process imports stays resident as long as it runs
(``kvserve serve`` is measured beside llama-server by ``kvserve bench
serve-memory``). ``kvserve --help`` imports them all to list them.

Bad values (an out-of-range flag, an unknown model) print ``error: <param>:
<message>`` and exit with code 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from kvserve import __version__
from kvserve.errors import InvalidParameterError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

Subparsers = Any  # argparse's _SubParsersAction, which has no public name
# Each subcommand's name and the module whose ``register(subparsers)`` adds it, in
# the order ``kvserve --help`` lists them.
COMMANDS: dict[str, str] = {
    "generate": "kvserve.entrypoints.generate",
    "chat": "kvserve.entrypoints.chat",
    "serve": "kvserve.entrypoints.openai.cli_serve",
    "bench": "kvserve.benchmarks.cli",
    "trace": "kvserve.trace.cli",
    "demo": "kvserve.demos.cli",
    "dashboard": "kvserve.dashboard.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvserve`` parser with every subcommand, or only ``command`` (one of ``COMMANDS``)."""
    if command is not None and command not in COMMANDS:
        raise InvalidParameterError(
            "command", f"must be one of {', '.join(COMMANDS)}, got {command!r}"
        )
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: a small paged-KV LLM inference engine."
    )
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The subcommand comes first (the top-level parser's only options, --help and
    # --version, end the run); anything else gets the full parser and its message.
    named = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(named).parse_args(argv)
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
