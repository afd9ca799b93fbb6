"""KVSERVE_CPU_ISA: a restricted instruction set behaves exactly like a CPU without the rest."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import kvserve.cpu_isa as isa
from kvserve.benchmarks import isa_switch
from kvserve.config.dtype import cpu_has_native_bf16, resolve_dtype_name
from kvserve.cpu_isa import CpuIsaError, restrict
from kvserve.errors import InvalidParameterError
from kvserve.kernels import NativeOps
from kvserve.kernels.build import build_library, load_library
from kvserve.kernels.weight_kind import WeightKind
from kvserve.worker.cpu_weights import can_prepack
from native_targets import cpu_flags

# An AMD Zen 4 (EPYC family 25 model 17), as /proc/cpuinfo lists it (vector part).
ZEN4 = frozenset(
    [
        "fpu",
        "sse",
        "sse2",
        "ssse3",
        "sse4_1",
        "sse4_2",
        "popcnt",
        "avx",
        "f16c",
        "fma",
        "bmi1",
        "bmi2",
        "avx2",
        "movbe",
        "xsave",
        "abm",
        "vaes",
        "vpclmulqdq",
        "sha_ni",
        "avx512f",
        "avx512dq",
        "avx512ifma",
        "avx512cd",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "avx512vbmi",
        "avx512_vbmi2",
        "gfni",
        "avx512_vnni",
        "avx512_bitalg",
        "avx512_vpopcntdq",
    ]
)
# The same CPU without its AVX-512: what an AVX2 machine (Zen 3, say) shows.
ZEN4_WITHOUT_AVX512 = frozenset(f for f in ZEN4 if not f.startswith("avx512"))
# A Sapphire Rapids-like CPU: AMX and AVX-VNNI too.
WITH_AMX = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8", "avx_vnni", "avx512_fp16"}


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A process whose CPU flags and KVSERVE_CPU_ISA a test sets; caches cleared around it."""
    isa.cpu_isa.cache_clear()
    yield monkeypatch
    isa.cpu_isa.cache_clear()


def choices_on(
    fake_cpu: pytest.MonkeyPatch, flags: frozenset[str], level: str
) -> dict[str, object]:
    """Every decision kvserve takes from CPU flags, on a CPU with ``flags`` at ``level``."""
    fake_cpu.setattr(isa, "cpu_flags", lambda: flags)
    fake_cpu.setenv(isa.ENV_VAR, level)
    isa.cpu_isa.cache_clear()
    return {
        "native_bf16": cpu_has_native_bf16(),
        "auto_with_kernels": resolve_dtype_name("auto", native_kernels=True),
        "auto_without_kernels": resolve_dtype_name("auto", native_kernels=False),
        "onednn_packing": can_prepack(torch.bfloat16, torch.device("cpu"))
        and torch.backends.mkldnn.is_available(),
        "vector_width": isa.cpu_isa().vector_width(),
    }


def test_avx2_level_removes_every_extension_above_avx2() -> None:
    restricted = restrict("avx2", WITH_AMX)
    assert restricted.march == "x86-64-v3" and restricted.restricted
    assert not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in restricted.flags)
    assert restricted.has("avx2", "fma", "f16c", "bmi2") and restricted.has("vaes")
    assert restricted.flags == WITH_AMX - {
        f for f in WITH_AMX if f.startswith(("avx512", "amx"))
    } - {"avx_vnni"}


def test_avx512_level_is_x86_64_v4_without_its_extensions() -> None:
    restricted = restrict("avx512", ZEN4)
    assert restricted.march == "x86-64-v4"
    assert restricted.has("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
    assert not restricted.has_any("avx512_bf16", "avx512_vnni", "avx512vbmi", "avx512ifma")


def test_native_keeps_everything_and_avx2_on_an_avx2_cpu_restricts_nothing() -> None:
    assert restrict("native", ZEN4).flags == ZEN4 and not restrict("native", ZEN4).restricted
    on_avx2_cpu = restrict("avx2", ZEN4_WITHOUT_AVX512)
    assert not on_avx2_cpu.restricted and on_avx2_cpu.flags == ZEN4_WITHOUT_AVX512
    assert on_avx2_cpu.describe() == "ISA: avx2 (all this CPU has)"
    assert restrict("avx2", ZEN4).describe().startswith("ISA: avx2 (restricted on")


@pytest.mark.parametrize(
    ("level", "flags", "words"),
    [
        ("avx512", ZEN4_WITHOUT_AVX512, ["'avx512' is above this CPU", "avx512f", "native, avx2"]),
        (
            "avx2",
            frozenset({"sse2", "avx"}),
            ["'avx2' is above this CPU", "fma", "allowed here: native"],
        ),
        ("sse9", ZEN4, ["'sse9'", "native, avx512, avx2"]),
    ],
)
def test_a_level_this_cpu_cannot_run_is_refused_naming_the_variable(
    level: str, flags: frozenset[str], words: list[str]
) -> None:
    with pytest.raises(CpuIsaError) as refused:
        restrict(level, flags)
    assert isinstance(refused.value, InvalidParameterError)
    assert refused.value.param == "KVSERVE_CPU_ISA"
    assert str(refused.value).startswith("KVSERVE_CPU_ISA: ")
    for word in words:
        assert word in str(refused.value)


@pytest.mark.parametrize("cpu", [ZEN4, WITH_AMX])
def test_every_choice_under_avx2_equals_a_cpu_without_avx512(
    fake_cpu: pytest.MonkeyPatch, cpu: frozenset[str]
) -> None:
    restricted = choices_on(fake_cpu, cpu, "avx2")
    lacking = frozenset(f for f in cpu if not f.startswith(("avx512", "amx", "avx_vnni")))
    assert restricted == choices_on(fake_cpu, lacking, "native")
    # The restriction is not vacuous: the full CPU decides differently.
    assert choices_on(fake_cpu, cpu, "native")["native_bf16"] is True
    assert restricted["native_bf16"] is False and restricted["onednn_packing"] is False


def test_the_avx2_kernel_build_takes_the_portable_paths() -> None:
    if platform.machine() != "x86_64" or "avx2" not in cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2")
    lib = load_library("x86-64-v3")
    if lib is None:
        pytest.skip("the C kernels could not be built here")
    ops = NativeOps(lib)
    assert not ops.bf16_dot
    assert (
        ops.weight_kind(torch.bfloat16) == WeightKind.BF16_WIDEN
        and ops.pool_kind(torch.bfloat16) == 1
    )


def _zmm_instructions(library: str) -> list[str]:
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", library], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in listing.splitlines() if "%zmm" in line]


def test_the_library_built_under_avx2_uses_no_zmm_register(fake_cpu: pytest.MonkeyPatch) -> None:
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    if platform.machine() != "x86_64" or "avx2" not in cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2")
    fake_cpu.setenv(isa.ENV_VAR, "avx2")
    isa.cpu_isa.cache_clear()
    assert _zmm_instructions(str(build_library())) == []
    if "avx512f" in cpu_flags():  # the check can fail: a native build here does use zmm
        fake_cpu.setenv(isa.ENV_VAR, "native")
        isa.cpu_isa.cache_clear()
        assert _zmm_instructions(str(build_library())) != []


def test_importing_kvserve_restricts_pytorch_onednn_and_mkl_too() -> None:
    if "avx2" not in cpu_flags():
        pytest.skip("needs a CPU with AVX2")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    }
    # MKL_VERBOSE makes MKL print the instruction set it runs at its first call (on
    # stdout, before the script's own line).
    script = (
        "import os, kvserve, torch; "
        "torch.ones(64, 64) @ torch.ones(64, 64); "
        "print('RESULT', torch.backends.cpu.get_cpu_capability(), "
        "os.environ['ONEDNN_MAX_CPU_ISA'], torch.backends.mkl.is_available())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env | {"KVSERVE_CPU_ISA": "avx2", "MKL_VERBOSE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = out[out.index("RESULT") :].split()
    assert result[1:3] == ["AVX2", "AVX2"]
    if result[3] == "True":  # PyTorch's float32 matmul is MKL's: restricted too
        banner = [line for line in out.splitlines() if "Advanced Vector Extensions" in line]
        assert banner and "(Intel(R) AVX2)" in banner[0], out[:400]


def test_bench_cpu_isa_reruns_the_benchmark_restricted(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(
        isa_switch.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 7
    )
    monkeypatch.setattr(isa_switch, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(sys, "argv", ["kvserve", "bench", "--cpu-isa", "avx2", "latency"])
    monkeypatch.delenv("KVSERVE_BENCH_ISA_CHILD", raising=False)
    ran: list[str] = []
    run = isa_switch.with_cpu_isa(lambda args: ran.append("here") or 0)
    assert run(argparse.Namespace(cpu_isa=None)) == 0 and ran == ["here"]
    assert run(argparse.Namespace(cpu_isa="avx2")) == 7 and ran == ["here"]
    command, env = calls[0]
    assert command[-4:] == ["bench", "--cpu-isa", "avx2", "latency"]
    assert env["KVSERVE_CPU_ISA"] == "avx2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    monkeypatch.setattr(isa_switch, "cpu_flags", lambda: ZEN4_WITHOUT_AVX512)
    with pytest.raises(CpuIsaError):
        run(argparse.Namespace(cpu_isa="avx512"))
    assert len(calls) == 1
