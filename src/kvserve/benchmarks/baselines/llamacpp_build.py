"""Build llama.cpp's own tools for the benchmarks, natively and for each restricted level.

``make bench-deps`` runs ``python -m kvserve.benchmarks.baselines.llamacpp_build native avx2``.
The sources are the llama.cpp that the llama-cpp-python sdist vendors (the
package registry is the only place this project fetches from); they are
downloaded, compiled here and kept in the cache folder, never committed.
Each level gets its own build under
``$KVSERVE_CACHE_DIR/llama.cpp/<version>-<level>/bin``:

- ``native``: ``GGML_NATIVE=ON`` (everything this CPU has);
- ``avx2``: ``GGML_NATIVE=OFF`` with AVX, AVX2, FMA, F16C and BMI2 on and
  every AVX-512 and AVX-VNNI option off, so it runs what a CPU with AVX2 and
  no AVX-512 runs, on any machine;
- ``avx512``: the same plus AVX-512 F/BW/CD/DQ/VL, without BF16, VNNI or VBMI.

The tools built: ``llama-bench``, ``llama-batched-bench``, ``llama-server``,
``llama-quantize`` and ``llama-perplexity`` (OpenMP on, as llama.cpp's
default build has it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvserve.cpu_isa import ISA_LEVELS, cpu_flags, restrict
from kvserve.private_cache import cache_root

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize", "llama-perplexity")

_COMMON = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_OPENMP=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
_AVX2_ON = ("AVX", "AVX2", "FMA", "F16C", "BMI2")
_AVX512_PARTS = ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")


def cmake_flags(level: str) -> list[str]:
    """The configure flags of the build for ``level``."""
    if level == "native":
        return [*_COMMON, "-DGGML_NATIVE=ON"]
    on = set(_AVX2_ON) | ({"AVX512"} if level == "avx512" else set())
    off = ({"AVX_VNNI", *_AVX512_PARTS}) - on
    return [
        *_COMMON,
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{name}=ON" for name in sorted(on)),
        *(f"-DGGML_{name}=OFF" for name in sorted(off)),
    ]


def tools_dir(level: str) -> Path:
    """Where the tools of ``level`` are (or will be) installed."""
    return cache_root() / "llama.cpp" / f"{SDIST_VERSION}-{level}" / "bin"


def _sources(workdir: Path) -> Path:
    """Download the sdist and unpack its vendored llama.cpp; returns the source folder."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"{SDIST}=={SDIST_VERSION}",
            "-d",
            str(workdir),
        ],
        check=True,
    )
    archive = next(workdir.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(workdir, members=members, filter="data")
    return next(workdir.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build(levels: list[str], jobs: int) -> None:
    """Build the tools for each of ``levels`` that is not built yet."""
    wanted = [level for level in levels if not all((tools_dir(level) / t).exists() for t in TOOLS)]
    for level in levels:
        restrict(level, cpu_flags())  # a level above this CPU is refused (the tools would not run)
    if not wanted:
        print(f"llama.cpp tools already built for: {', '.join(levels)}")
        return
    with tempfile.TemporaryDirectory(prefix="kvserve-llamacpp-") as tmp:
        source = _sources(Path(tmp))
        for level in wanted:
            build_dir = Path(tmp) / f"build-{level}"
            subprocess.run(
                ["cmake", "-S", str(source), "-B", str(build_dir), *cmake_flags(level)], check=True
            )
            subprocess.run(
                ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS],
                check=True,
            )
            target = tools_dir(level)
            target.mkdir(parents=True, exist_ok=True)
            for tool in TOOLS:
                shutil.copy2(build_dir / "bin" / tool, target / tool)
            print(f"llama.cpp {SDIST_VERSION} tools for {level}: {target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("levels", nargs="+", choices=ISA_LEVELS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    build(list(dict.fromkeys(args.levels)), args.jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
