"""Every demo, run once per session on a tiny random Llama with shrunken workloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo_fixtures import tiny_context
from kvserve.demos import DemoResult, run_demo
from model_fixtures import save_tiny_model, train_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", train_tiny_tokenizer())


class _LazyResults(dict[str, DemoResult]):
    """Runs a demo the first time a test asks for its result."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        self.model_dir = model_dir

    def __missing__(self, name: str) -> DemoResult:
        self[name] = run_demo(name, tiny_context(self.model_dir, name))
        return self[name]


@pytest.fixture(scope="session")
def demo_results(tiny_model_dir: Path) -> dict[str, DemoResult]:
    """Each demo's result on the tiny model, computed once and shared by the tests."""
    return _LazyResults(tiny_model_dir)
