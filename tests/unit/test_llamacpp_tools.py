"""llama.cpp's own tools in the benchmarks: the build flags per level, the commands, the parsing.

The tools themselves are built by ``make bench-deps`` (minutes of compiling), so
these tests stand small scripts in for them that check the arguments they get
and print what the real tools print.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvserve.benchmarks.baselines import llamacpp_tools
from kvserve.benchmarks.baselines.llamacpp_build import TOOLS, cmake_flags
from kvserve.benchmarks.baselines.llamacpp_tools import (
    ToolBuild,
    batched_bench,
    llama_bench,
    tool_build,
)
from kvserve.errors import InvalidParameterError


def test_the_avx2_build_turns_every_avx512_option_off() -> None:
    flags = cmake_flags("avx2")
    assert "-DGGML_NATIVE=OFF" in flags
    for name in ("AVX", "AVX2", "FMA", "F16C", "BMI2"):
        assert f"-DGGML_{name}=ON" in flags
    for name in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI"):
        assert f"-DGGML_{name}=OFF" in flags
    assert "-DGGML_AVX512=ON" in cmake_flags("avx512") and "-DGGML_NATIVE=ON" in cmake_flags(
        "native"
    )


def fake_tool(folder: Path, name: str, expected_args: str, output: str) -> None:
    """A shell script named ``name`` that prints ``output`` if its arguments contain ``expected_args``."""
    script = folder / name
    script.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *"{expected_args}"*) ;; *) echo "bad args: $*" >&2; exit 3;; esac\n'
        f"cat <<'OUT'\n{output}\nOUT\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


LLAMA_BENCH_JSON = """[
  {"n_prompt": 0, "n_gen": 64, "n_depth": 128, "samples_ts": [90.0, 100.0, 80.0]},
  {"n_prompt": 0, "n_gen": 64, "n_depth": 512, "samples_ts": [70.0, 75.0, 72.0]}
]"""

BATCHED_OUTPUT = """main: n_kv_max = 17024, n_batch = 2048
{"n_kv_max": 17024, "pp": 128, "tg": 64, "pl": 1, "n_kv": 192, "t_pp": 0.1, "speed_pp": 1280.0, "t_tg": 0.8, "speed_tg": 80.0, "t": 0.9, "speed": 213.3}
{"n_kv_max": 17024, "pp": 128, "tg": 64, "pl": 16, "n_kv": 3072, "t_pp": 1.6, "speed_pp": 1280.0, "t_tg": 2.0, "speed_tg": 512.0, "t": 3.6, "speed": 853.3}

llama_perf_context_print: load time = 10 ms"""


def test_llama_bench_median_of_samples_per_depth(tmp_path: Path) -> None:
    fake_tool(tmp_path, "llama-bench", "-p 0 -n 64 -d 128,512 -fa 1 -o json", LLAMA_BENCH_JSON)
    rows = llama_bench(
        ToolBuild(tmp_path, "avx2"), Path("m.gguf"), 2, 3, n_gen=64, depths=(128, 512)
    )
    assert [(r.n_depth, r.tokens_per_s) for r in rows] == [(128, 90.0), (512, 72.0)]


def test_batched_bench_reads_its_jsonl_rows(tmp_path: Path) -> None:
    fake_tool(tmp_path, "llama-batched-bench", "-npp 128 -ntg 64 -npl 1,16 -fa on", BATCHED_OUTPUT)
    rows = batched_bench(ToolBuild(tmp_path, "avx2"), Path("m.gguf"), 2, 128, 64, (1, 16))
    assert [(r.sequences, r.decode_tokens_per_s) for r in rows] == [(1, 80.0), (16, 512.0)]


def test_a_failing_tool_raises_with_its_message(tmp_path: Path) -> None:
    fake_tool(tmp_path, "llama-bench", "never matches", "")
    with pytest.raises(RuntimeError, match=r"llama-bench failed .*bad args"):
        llama_bench(ToolBuild(tmp_path, "avx2"), Path("m.gguf"), 2, 1, n_gen=8)


def test_a_missing_build_is_refused_naming_how_to_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llamacpp_tools, "tools_dir", lambda level: tmp_path / level)
    with pytest.raises(InvalidParameterError, match="make bench-deps"):
        tool_build()
    (tmp_path / "avx2").mkdir()
    for tool in TOOLS:
        (tmp_path / "avx2" / tool).touch()
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx2")
    llamacpp_tools.cpu_isa.cache_clear()
    try:
        assert tool_build() == ToolBuild(tmp_path / "avx2", "avx2")
    finally:
        monkeypatch.delenv("KVSERVE_CPU_ISA")
        llamacpp_tools.cpu_isa.cache_clear()
