"""``kvserve bench --cpu-isa LEVEL``: measure in a process restricted to an instruction set.

PyTorch, oneDNN and PyTorch's MKL choose their kernels once, at first use, from
``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS``;
kvserve reads ``KVSERVE_CPU_ISA`` (:mod:`kvserve.cpu_isa`). When the level asked
for is not the one this process already runs, the benchmark runs again as a child
process with all four set, so everything measured (kvserve, transformers, and the
llama.cpp tools it starts, which take the build for that level) is restricted
the same way. The child's exit code is the command's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable

from kvserve.cpu_isa import ENV_VAR, ISA_LEVELS, cpu_flags, library_environment, restrict

Run = Callable[[argparse.Namespace], int]
# Set in the child, so it never starts another.
_CHILD_MARK = "KVSERVE_BENCH_ISA_CHILD"


def add_cpu_isa_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu-isa",
        choices=ISA_LEVELS,
        default=None,
        help=(
            f"restrict kvserve, PyTorch, oneDNN and llama.cpp to this instruction set "
            f"(sets {ENV_VAR}; default: the environment's, else native)"
        ),
    )


def child_environment(level: str) -> dict[str, str]:
    """The environment of the restricted run: the variables of ``level``, and none of another's."""
    env = {k: v for k, v in os.environ.items() if k not in library_environment("avx2")}
    env.update(library_environment(level))
    env[ENV_VAR] = level
    env[_CHILD_MARK] = "1"
    return env


def with_cpu_isa(run: Run) -> Run:
    """``run``, started again in a restricted process when ``--cpu-isa`` asks for another level."""

    def restricted_run(args: argparse.Namespace) -> int:
        level = getattr(args, "cpu_isa", None)
        if level is None or os.environ.get(_CHILD_MARK):
            return run(args)
        restrict(level, cpu_flags())  # an unsupported level is refused before anything runs
        command = [sys.executable, "-m", "kvserve.cli", *sys.argv[1:]]
        return subprocess.call(command, env=child_environment(level))

    return restricted_run
