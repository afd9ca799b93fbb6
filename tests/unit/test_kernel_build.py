"""Building, caching and choosing the C kernels, and falling back when they are off."""

from __future__ import annotations

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
    if build.load_library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    first = build.build_library()
    assert first.parent == tmp_path and first.exists()
    built_at = first.stat().st_mtime_ns
    assert build.build_library() == first  # found in the cache, not rebuilt
    assert first.stat().st_mtime_ns == built_at
    monkeypatch.setattr(build, "_cpu_flags", lambda: "some other cpu")
    other = build.build_library()
    assert other != first and other.exists()  # code for another CPU gets its own file


def test_compiler_errors_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises((build.KernelBuildError, OSError)):
        build.build_library()


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
