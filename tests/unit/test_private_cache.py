"""The private cache folder: created 0700, and only files of the current user that no one
else can write are trusted (for the kernel library as for everything else kvserve caches)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from kvserve.kernels import build
from kvserve.private_cache import (
    UntrustedCacheError,
    atomic_target,
    cache_root,
    is_trusted_file,
    private_cache_dir,
    untrusted_reason,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
OTHER_UID = 65534  # "nobody"


def test_cache_root_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", "")
    assert cache_root() == Path.home() / ".cache" / "kvserve"


def test_folders_are_created_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = private_cache_dir("models", "entry")
    assert folder == tmp_path / "cache" / "models" / "entry"
    for path in (tmp_path / "cache", tmp_path / "cache" / "models", folder):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_a_folder_others_can_write_to_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(shared))
    with pytest.raises(UntrustedCacheError, match="group or others write"):
        private_cache_dir()
    shared.chmod(0o700)
    (shared / "sub").mkdir(mode=0o700)
    (shared / "sub").chmod(0o770)
    with pytest.raises(UntrustedCacheError, match="sub"):
        private_cache_dir("sub")


def test_only_own_regular_files_that_others_cannot_write_are_trusted(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.write_bytes(b"x")
    good.chmod(0o644)
    assert is_trusted_file(good)
    assert untrusted_reason(tmp_path / "missing") == "it does not exist"
    writable = tmp_path / "writable"
    writable.write_bytes(b"x")
    writable.chmod(0o666)
    assert "group or others write" in (untrusted_reason(writable) or "")
    link = tmp_path / "link"
    link.symlink_to(good)
    assert "not a regular file" in (untrusted_reason(link) or "")
    assert untrusted_reason(tmp_path, folder=True) is None
    assert "not a regular file" in (untrusted_reason(tmp_path) or "")


@needs_root
def test_a_file_of_another_user_is_not_trusted(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.write_bytes(b"x")
    planted.chmod(0o644)
    os.chown(planted, OTHER_UID, OTHER_UID)
    assert f"owned by uid {OTHER_UID}" in (untrusted_reason(planted) or "")


def test_atomic_target_renames_on_success_and_cleans_up_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "file"
    with atomic_target(target) as tmp:
        assert tmp.parent == tmp_path and tmp.exists() and not target.exists()
        tmp.write_text("done")
    assert target.read_text() == "done"
    with pytest.raises(RuntimeError), atomic_target(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "done"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_kernel_library_others_can_write_to_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if build.load_library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    target, _ = build.library_path(build._compiler())
    target.write_bytes(b"not a library")
    target.chmod(0o666)
    with caplog.at_level(logging.WARNING):
        assert build.build_library() == target
    assert "rebuilding the C kernels" in caplog.text
    assert is_trusted_file(target)
    assert target.read_bytes()[:4] == b"\x7fELF"
