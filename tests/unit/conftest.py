"""Fixtures shared by the unit tests."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.build import load_library
from native_targets import TARGETS, cpu_flags


@pytest.fixture(scope="module", params=TARGETS)
def ops(request: pytest.FixtureRequest) -> NativeOps:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: kvserve runs on its PyTorch fallbacks")
    if request.param == "native":
        loaded = native_ops()
    else:
        if platform.machine() != "x86_64" or "avx2" not in cpu_flags():
            pytest.skip("the AVX2 build runs on x86-64 CPUs with AVX2 only")
        lib = load_library(request.param)
        loaded = None if lib is None else NativeOps(lib)
    assert loaded is not None, "a C compiler is present, yet the kernels did not build (see log)"
    return loaded


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kvserve cache folder of the test's own, with the weight cache on, so a test
    never reads entries another test (or the user) left. Cache tests take it for every test
    with ``pytestmark = pytest.mark.usefixtures("cache_dir")``."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(folder))
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "1")
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_DIR", raising=False)
    return folder
