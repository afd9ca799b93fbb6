"""The instruction set kvserve targets: the CPU's own, or a restriction of it.

``KVSERVE_CPU_ISA`` chooses it:

- ``native`` (the default): everything the CPU has; the kernels are built with
  ``-march=native``.
- ``avx512``: x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), without the AVX-512
  extensions beyond it (BF16, VNNI, VBMI, FP16, ...) and without AMX or
  AVX-VNNI; kernels built with ``-march=x86-64-v4``.
- ``avx2``: x86-64-v3 (AVX2, FMA, F16C, BMI1/2), no AVX-512, no AVX-VNNI, no
  AMX; kernels built with ``-march=x86-64-v3``.

A restricted level makes kvserve behave exactly as it would on a CPU whose
flags lack the removed extensions: every decision that reads CPU flags
(``dtype=auto``, oneDNN weight packing, the bf16 dot-product kernels, the
benchmark roofline's dtype) reads :func:`cpu_isa`'s flags, never
``/proc/cpuinfo`` directly. PyTorch, oneDNN and the MKL inside PyTorch (its
float32 matrix products) follow through their own variables
(``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``),
which they read once, at their first use: :func:`library_environment` gives them, and
``kvserve bench --cpu-isa`` starts its measured process with them set.

A level above what the CPU has is refused (:class:`CpuIsaError`), naming the
variable and the levels this CPU allows.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from typing import Literal, NamedTuple

from kvserve.errors import InvalidParameterError

ENV_VAR = "KVSERVE_CPU_ISA"
IsaLevel = Literal["native", "avx512", "avx2"]
ISA_LEVELS: tuple[IsaLevel, ...] = ("native", "avx512", "avx2")

# What each restricted level requires of the CPU (Linux /proc/cpuinfo flag names).
_REQUIRED: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"}),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2"}),
}
# Flags a restricted level removes: vector and matrix extensions above it.
_ABOVE_AVX2_PREFIXES = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")
_X86_64_V4_AVX512 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
_MARCH: dict[str, str] = {"native": "native", "avx512": "x86-64-v4", "avx2": "x86-64-v3"}
# PyTorch's, oneDNN's and MKL's names for each restricted level. MKL's ``AVX512`` is
# AVX-512 without VNNI; without MKL's variable PyTorch's float32 matmul keeps AVX-512.
_ATEN: dict[str, str] = {"avx512": "avx512", "avx2": "avx2"}
_ONEDNN: dict[str, str] = {"avx512": "AVX512_CORE", "avx2": "AVX2"}
_MKL: dict[str, str] = {"avx512": "AVX512", "avx2": "AVX2"}


class CpuIsaError(InvalidParameterError):
    """``KVSERVE_CPU_ISA`` names an unknown level or one above what this CPU has."""

    def __init__(self, message: str) -> None:
        super().__init__(ENV_VAR, message)


class CpuIsa(NamedTuple):
    """The instruction set kvserve targets, and the CPU flags it may use.

    level: the requested level; flags: the CPU's flags less those the level
    removes; march: the ``-march`` the C kernels are compiled with;
    restricted: whether the level removed any flag this CPU has.
    """

    level: IsaLevel
    flags: frozenset[str]
    march: str
    restricted: bool

    def has(self, *flags: str) -> bool:
        """Whether every one of ``flags`` may be used."""
        return all(flag in self.flags for flag in flags)

    def has_any(self, *flags: str) -> bool:
        """Whether at least one of ``flags`` may be used."""
        return any(flag in self.flags for flag in flags)

    def vector_width(self) -> str:
        """The widest vector unit in use, for reports: AVX-512, AVX2 or neither."""
        if self.has("avx512f"):
            return "AVX-512"
        return "AVX2" if self.has("avx2") else "below AVX2"

    def describe(self) -> str:
        """``ISA: avx2 (restricted on an AVX-512 CPU)``, or ``ISA: native (AVX2)``."""
        if self.level == "native":
            return f"ISA: native ({self.vector_width()})"
        if self.restricted:
            host = "an AVX-512" if cpu_flags() >= _X86_64_V4_AVX512 else "this"
            return f"ISA: {self.level} (restricted on {host} CPU)"
        return f"ISA: {self.level} (all this CPU has)"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's own feature flags (Linux /proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def allowed_levels(flags: frozenset[str]) -> tuple[IsaLevel, ...]:
    """The levels a CPU with ``flags`` can run."""
    return tuple(level for level in ISA_LEVELS if level == "native" or _REQUIRED[level] <= flags)


def restrict(level: str, flags: frozenset[str]) -> CpuIsa:
    """The instruction set ``level`` leaves of a CPU with ``flags``; raises :class:`CpuIsaError`."""
    if level not in ISA_LEVELS:
        raise CpuIsaError(
            f"{level!r} is not an instruction-set level kvserve knows; "
            f"allowed: {', '.join(ISA_LEVELS)}"
        )
    if level != "native" and not _REQUIRED[level] <= flags:
        missing = ", ".join(sorted(_REQUIRED[level] - flags))
        raise CpuIsaError(
            f"{level!r} is above this CPU ({platform.machine()}, which lacks {missing}); "
            f"allowed here: {', '.join(allowed_levels(flags))}"
        )
    kept = flags
    if level != "native":
        kept = frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2_PREFIXES))
        if level == "avx512":
            kept |= _X86_64_V4_AVX512
    return CpuIsa(level, kept, _MARCH[level], restricted=kept != flags)


def requested_level() -> str:
    """The level ``KVSERVE_CPU_ISA`` asks for (``native`` when unset or empty)."""
    return os.environ.get(ENV_VAR, "").strip().lower() or "native"


@functools.cache
def cpu_isa() -> CpuIsa:
    """The instruction set of this process, from ``KVSERVE_CPU_ISA`` (read once)."""
    return restrict(requested_level(), cpu_flags())


def library_environment(level: str) -> dict[str, str]:
    """The variables that restrict PyTorch's, oneDNN's and MKL's kernels to ``level``.

    The libraries read them once, at first use, so they must be in the
    environment before the process that measures starts; ``native`` sets none.
    """
    if level == "native":
        return {}
    return {
        ENV_VAR: level,
        "ATEN_CPU_CAPABILITY": _ATEN[level],
        "ONEDNN_MAX_CPU_ISA": _ONEDNN[level],
        "MKL_ENABLE_INSTRUCTIONS": _MKL[level],
    }


def apply_library_restriction() -> None:
    """Put ``KVSERVE_CPU_ISA``'s restriction into PyTorch's, oneDNN's and MKL's variables.

    Called when kvserve is imported, so that a process started with only
    ``KVSERVE_CPU_ISA=avx2`` runs PyTorch's AVX2 kernels too. Variables the
    user set are kept. An unknown or unsupported level is left for
    :func:`cpu_isa` to refuse where kvserve first reads it. When PyTorch was
    imported and already chose its kernels, a warning says the restriction
    reaches kvserve's own kernels only.
    """
    level = requested_level()
    if level == "native" or level not in allowed_levels(cpu_flags()):
        return
    for name, value in library_environment(level).items():
        os.environ.setdefault(name, value)
    torch = sys.modules.get("torch")
    if torch is not None:
        chosen = torch.backends.cpu.get_cpu_capability()
        if chosen.lower() != _ATEN[level] and not chosen.lower().startswith(_ATEN[level]):
            warnings.warn(
                f"{ENV_VAR}={level}: PyTorch was imported before kvserve and runs its "
                f"{chosen} kernels; set ATEN_CPU_CAPABILITY={_ATEN[level]}, "
                f"ONEDNN_MAX_CPU_ISA={_ONEDNN[level]} and MKL_ENABLE_INSTRUCTIONS={_MKL[level]} "
                "before starting Python",
                stacklevel=2,
            )
