"""Models named by Hugging Face hub id run from a hub cache folder the tests build.

Nothing is downloaded: HF_HUB_OFFLINE is set for every test (see conftest.py).
The cache holds a tiny random GPT-2 at two commits, ``main`` and the tag
``v2`` (other weights), in huggingface_hub's layout of blobs, snapshots and refs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from kvserve import LLM, SamplingParams
from model_fixtures import add_to_hub_cache, save_tiny_model, train_tiny_tokenizer

REPO_ID = "kvserve-tests/tiny-gpt2"
MAIN_COMMIT = "1111111111111111111111111111111111111111"
V2_COMMIT = "2222222222222222222222222222222222222222"
PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny GPT-2 twice, with different weights, as plain folders."""
    tokenizer = train_tiny_tokenizer()
    return {
        revision: save_tiny_model(tmp_path_factory.mktemp(revision), "gpt2", tokenizer, seed=seed)
        for revision, seed in (("main", 0), ("v2", 1))
    }


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]) -> Path:
    """An HF_HOME whose hub cache (``hub/``) holds both revisions."""
    home = tmp_path_factory.mktemp("hf_home")
    add_to_hub_cache(home / "hub", REPO_ID, folders["main"], MAIN_COMMIT)
    add_to_hub_cache(home / "hub", REPO_ID, folders["v2"], V2_COMMIT, ref="v2")
    return home


def greedy_text(model: str, **engine_args: object) -> str:
    llm = LLM(model, dtype="float32", num_blocks=64, **engine_args)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text


def test_a_hub_id_and_its_revisions_run_the_cached_weights(
    folders: dict[str, Path], hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    main_text = greedy_text(str(folders["main"]))
    v2_text = greedy_text(str(folders["v2"]))
    assert main_text != v2_text  # the two revisions are told apart by their outputs
    assert greedy_text(REPO_ID) == main_text
    assert greedy_text(REPO_ID, revision="v2") == v2_text
    assert greedy_text(REPO_ID, revision=V2_COMMIT) == v2_text


def run_cli(hf_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvserve generate`` in a new process whose environment sets HF_HOME and HF_HUB_OFFLINE."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
    }
    env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "kvserve.cli", "generate", "--dtype", "float32"]
    command += ["--temperature", "0", "--max-tokens", "8", "--ignore-eos", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_the_cli_honours_hf_home_and_hf_hub_offline(
    folders: dict[str, Path], hf_home: Path
) -> None:
    # The environment is read as huggingface_hub loads, so only a new process shows it is used.
    found = run_cli(hf_home, "--model", REPO_ID, "--revision", "v2", PROMPT)
    assert found.returncode == 0, found.stderr
    assert found.stdout == greedy_text(str(folders["v2"])) + "\n"
    missing = run_cli(hf_home, "--model", "kvserve-tests/not-downloaded", PROMPT)
    assert missing.returncode == 2
    assert "'kvserve-tests/not-downloaded'" in missing.stderr
    assert f"not in the local Hugging Face cache ({hf_home / 'hub'})" in missing.stderr
