"""Compile kvserve's C kernels for this CPU on first use and load them with ctypes.

The kernels are plain C (GCC vector extensions and OpenMP), built with
``-O3 -march=native`` so each machine gets code for its own vector units
(``-march=x86-64-v3`` or ``x86-64-v4`` when ``KVSERVE_CPU_ISA`` restricts
kvserve to AVX2 or AVX-512: see :mod:`kvserve.cpu_isa`). The
shared library is cached under ``$KVSERVE_CACHE_DIR`` (default
``~/.cache/kvserve``) in a file named by a hash of the sources, the compiler
flags, the compiler's version and the CPU's feature flags: a new machine or a
changed kernel builds afresh, an unchanged one loads in milliseconds. A cached
library is loaded only when it passes :mod:`kvserve.private_cache`'s checks
(owned by the current user, writable by no one else); otherwise it is rebuilt.
Builds hold a lock file in the cache folder: processes started together
compile once, the others wait and load that build. A failed build leaves no
file behind, and a build killed halfway leaves its temporary file only until
the next build.

No Python headers or PyTorch headers are involved, so a build takes about a
second. OpenMP resolves to the ``libgomp`` PyTorch has already loaded, so the
kernels and PyTorch's own operators share one thread pool.

Set ``KVSERVE_NATIVE_KERNELS=0`` to run on the PyTorch fallbacks only. Where
no C compiler is found or the build fails, the fallbacks are used and a
warning says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

from kvserve.cpu_isa import cpu_flags, cpu_isa
from kvserve.private_cache import (
    atomic_target,
    cache_root,
    exclusive_lock,
    private_cache_dir,
    untrusted_reason,
)

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
LIBRARY_PREFIX = "kvserve_kernels-"
# Held while building any of the kernel libraries in the cache folder.
LOCK_NAME = "kvserve_kernels.lock"
CFLAGS = (
    "-O3",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=gnu11",
    "-ffp-contract=fast",
    "-Wall",
)


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded."""


def native_kernels_enabled() -> bool:
    """False when the user turned the kernels off with ``KVSERVE_NATIVE_KERNELS=0``."""
    return os.environ.get("KVSERVE_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no")


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    return compiler


def _cpu_flags() -> str:
    """The CPU's feature flags: code built with -march=native is only valid on a CPU like it."""
    return " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()


def _flags(march: str) -> list[str]:
    return [*CFLAGS, f"-march={march}"]


def library_path(compiler: str, march: str | None = None) -> tuple[Path, list[Path]]:
    """Where the library for the current sources, compiler and CPU lives, and its sources.

    march: the ``-march`` the kernels are compiled for: ``native`` (this CPU), or
    the level ``KVSERVE_CPU_ISA`` restricts kvserve to (``x86-64-v3``: AVX2
    without AVX-512), which tests also build directly, so one machine
    exercises the code another kind of CPU runs. It is part of the cache key.
    """
    march = march or cpu_isa().march
    sources = sorted(SOURCE_DIR.glob("*.c"))
    headers = sorted(SOURCE_DIR.glob("*.h"))
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256()
    # Headers too: a changed struct in kernels.h must never load a library built before it.
    for part in (
        *(s.read_bytes() for s in (*sources, *headers)),
        " ".join(_flags(march)).encode(),
    ):
        digest.update(part)
    digest.update(version.encode())
    digest.update(_cpu_flags().encode())
    return cache_root() / f"{LIBRARY_PREFIX}{digest.hexdigest()[:16]}.so", sources


def build_library(march: str | None = None) -> Path:
    """Compile the kernels unless a build for these sources and this CPU is cached.

    march: default, the level of ``KVSERVE_CPU_ISA`` (see :mod:`kvserve.cpu_isa`).
    """
    march = march or cpu_isa().march
    compiler = _compiler()
    target, sources = library_path(compiler, march)
    folder = private_cache_dir()  # the folder is checked before anything in it is trusted
    if untrusted_reason(target) is None:
        return target
    with exclusive_lock(folder / LOCK_NAME):
        # Whoever held the lock before may have built this very library.
        reason = untrusted_reason(target)
        if reason is None:
            return target
        if os.path.lexists(target):
            logger.warning(
                "rebuilding the C kernels: the cached %s is not used: %s", target, reason
            )
        # Kernel builds all hold this lock, so any temporary library here is a killed one's.
        for leftover in folder.glob(f".{LIBRARY_PREFIX}*"):
            leftover.unlink(missing_ok=True)
        _compile(compiler, march, sources, target)
    return target


def _compile(compiler: str, march: str, sources: list[Path], target: Path) -> None:
    """Compile ``sources`` into ``target`` through a temporary name.

    The rename means a loader never sees half a file; a failed build's output is removed.
    """
    with atomic_target(target, ".so") as tmp_path:
        command = [compiler, *_flags(march), f"-I{SOURCE_DIR}", "-o", str(tmp_path)]
        result = subprocess.run(
            [*command, *map(str, sources), "-lm"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise KernelBuildError(f"compiling the C kernels failed:\n{result.stderr.strip()}")


@functools.cache
def load_library(march: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels, or None (with a warning) when they are off or cannot be built.

    march: see :func:`library_path`; kvserve itself runs the level of
    ``KVSERVE_CPU_ISA`` (``native`` unless restricted), which is the default.
    """
    if not native_kernels_enabled():
        return None
    import torch  # noqa: F401  (loads PyTorch's libgomp first, so the kernels share it)

    try:
        return ctypes.CDLL(str(build_library(march)))
    except (KernelBuildError, OSError) as exc:
        logger.warning("kvserve's C kernels are unavailable, using PyTorch fallbacks: %s", exc)
        return None
