"""Settings every test starts from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest

from model_fixtures import save_tiny_model, train_tiny_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _no_converted_model_cache() -> Iterator[None]:
    """Tests read models from their files and leave the user's cache alone.

    Session-scoped so that module-scoped engines are covered too; the tests of
    the cache itself turn it back on, in a temporary folder.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_WEIGHT_CACHE", "0")
        yield


@pytest.fixture(autouse=True, scope="session")
def _hugging_face_hub_offline() -> Iterator[None]:
    """No test downloads: hub ids resolve from a cache folder the test builds, or fail.

    huggingface_hub reads HF_HUB_OFFLINE when it is imported, so the setting it
    already holds is patched too; the variable covers child processes.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with its tokenizer, shared by the server tests."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", train_tiny_tokenizer())
