"""Building, caching and choosing the C kernels, and falling back when they are off."""

from __future__ import annotations

import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch

from kvserve.attention import NativePagedAttention, TorchPagedAttention, get_attention_backend
from kvserve.config import ModelConfig
from kvserve.errors import InvalidParameterError
from kvserve.kernels import build

CPU = torch.device("cpu")


def test_build_is_cached_per_source_and_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in compiler: the cache's logic is what is tested here, and every test
    # that multiplies anything builds the real kernels (two real builds took 30 s).
    compiler, log = fake_compiler(tmp_path, exit_status=0)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = build.build_library()
    assert first.parent == tmp_path / "cache" and first.read_text() == "library"
    built_at = first.stat().st_mtime_ns
    assert build.build_library() == first  # found in the cache, not rebuilt
    assert first.stat().st_mtime_ns == built_at
    assert log.read_text().splitlines() == ["compile"]
    monkeypatch.setattr(build, "_cpu_flags", lambda: "some other cpu")
    other = build.build_library()
    assert other != first and other.exists()  # code for another CPU gets its own file
    assert log.read_text().splitlines() == ["compile", "compile"]


def test_compiler_errors_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises((build.KernelBuildError, OSError)):
        build.build_library()


def fake_compiler(folder: Path, exit_status: int) -> tuple[Path, Path]:
    """A stand-in for cc that logs each compile, takes a second, writes its -o file and exits.

    Returns the script and its log (one line per compile). The second makes two
    builders started together overlap, as two processes loading kvserve at once do.
    """
    log = folder / "compiles.log"
    script = folder / "fake-cc"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake-cc 1.0"; exit 0; fi\n'
        'prev=""; for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done\n'
        f'echo compile >> "{log}"\n'
        "sleep 1\n"
        'printf "library" > "$out"\n'
        f"exit {exit_status}\n"
    )
    script.chmod(0o700)
    return script, log


def test_concurrent_builds_compile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler, log = fake_compiler(tmp_path, exit_status=0)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    built: list[Path] = []
    builders = [threading.Thread(target=lambda: built.append(build.build_library())) for _ in "ab"]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join(60)
        assert not builder.is_alive(), "a builder is still waiting for the lock"
    # The second builder waited for the first's lock, then found its library.
    assert len(built) == 2 and built[0] == built[1]
    assert built[0].read_text() == "library"
    assert log.read_text().splitlines() == ["compile"]
    lock = tmp_path / "cache" / build.LOCK_NAME
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_the_cache_key_covers_every_source_and_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, sources)
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    compiler, _ = fake_compiler(tmp_path, exit_status=0)
    files = sorted(p for p in sources.iterdir() if p.suffix in (".c", ".h"))
    assert {".c", ".h"} <= {p.suffix for p in files}
    keys = {build.library_path(str(compiler))[0]}
    for path in files:
        with path.open("a") as source:
            source.write("\n/* changed */\n")
        keys.add(build.library_path(str(compiler))[0])
    assert len(keys) == len(files) + 1  # each edit gave a new key


def test_a_failed_build_leaves_no_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler, log = fake_compiler(tmp_path, exit_status=1)  # writes half a library, then fails
    monkeypatch.setenv("CC", str(compiler))
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    cache.mkdir(mode=0o700)
    # What a build killed halfway leaves behind; the next build, holding the lock, removes it.
    (cache / ".kvserve_kernels-0123456789abcdef.so.x1y2z3.so").write_bytes(b"half")
    with pytest.raises(build.KernelBuildError, match="compiling the C kernels failed"):
        build.build_library()
    assert log.read_text().splitlines() == ["compile"]
    assert [p.name for p in cache.iterdir()] == [build.LOCK_NAME]


def test_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "0")
    assert not build.native_kernels_enabled()
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "1")
    assert build.native_kernels_enabled()


def test_auto_backend_takes_the_kernels_only_where_they_apply() -> None:
    native = get_attention_backend("auto", torch.float32, CPU, 9, 3, 64)
    if build.load_library() is not None:
        assert isinstance(native, NativePagedAttention)
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.float32, 12)):
        backend = get_attention_backend("auto", dtype, CPU, 9, 3, head_dim)
        assert isinstance(backend, TorchPagedAttention)
        assert not isinstance(backend, NativePagedAttention)


def test_forcing_native_where_it_cannot_run_names_the_parameter() -> None:
    with pytest.raises(InvalidParameterError) as info:
        get_attention_backend("native_paged", torch.bfloat16, CPU, 9, 3, 64)
    assert info.value.param == "attention_backend"
    with pytest.raises(InvalidParameterError, match="attention_backend"):
        ModelConfig(attention_backend="flash")  # type: ignore[arg-type]
