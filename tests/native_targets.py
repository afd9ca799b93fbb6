"""The instruction sets the kernel tests run on (the ``ops`` fixture is in unit/conftest.py)."""

from __future__ import annotations


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


# The kernels as this CPU runs them, and (on x86-64 CPUs with AVX2) as built for an AVX2
# CPU without AVX-512: every kernel test runs on both, so an AVX-512 machine also checks
# the code an AVX2 machine runs.
TARGETS = ["native", "x86-64-v3"]
