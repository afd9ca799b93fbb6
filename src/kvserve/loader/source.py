"""Where a model's files are: the result of resolving what the user asked for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class ModelSource:
    """A resolved model.

    kind: ``hf`` for a Hugging Face folder (config.json + safetensors, tokenizer
        files), ``gguf`` for a single llama.cpp GGUF file.
    path: the folder (hf) or the ``.gguf`` file (gguf), absolute.
    name: what the user asked for (alias, path or hub id), for messages.
    """

    kind: Literal["hf", "gguf"]
    path: Path
    name: str
