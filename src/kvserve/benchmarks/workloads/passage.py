"""A fixed English passage for perplexity: three short pieces of original prose, shipped
with the package (``passage.txt``, about 4,500 tokens), so that every run scores the
same text and nothing is downloaded."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def passage_path() -> Path:
    """The passage's file, for tools that read it themselves (``llama-perplexity -f``)."""
    path = resources.files("kvserve.benchmarks.workloads") / "passage.txt"
    return Path(str(path))


def passage_text() -> str:
    return passage_path().read_text(encoding="utf-8")
