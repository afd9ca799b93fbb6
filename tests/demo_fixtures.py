"""The demos shrunk for tests: per demo, sizes that make it run in about a second on a
tiny random model (see ``DemoContext.sizes``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.demos import DemoContext

# Per demo: the sizes that make it run in about a second on the tiny model. The random
# model rarely emits EOS, so the batching demos set each answer's length instead.
SHRUNK_SIZES: dict[str, dict[str, Any]] = {
    "static-vs-continuous": {"max_tokens_each": (24, 3, 5, 20, 4, 18, 7, 22)},
    "waste": {"max_tokens_each": (3, 9, 14, 25)},
    "kv-memory": {
        "concurrencies": (1, 2, 4, 8),
        "min_prompt_tokens": 8,
        "max_prompt_tokens": 96,
        "min_output_tokens": 2,
        "max_output_tokens": 40,
    },
    "prefix-cache": {"num_requests": 4, "note_sentences": 3, "max_tokens": 4, "repeats": 2},
}


def tiny_context(model_dir: Path, name: str) -> DemoContext:
    """Demo ``name`` on the tiny model at ``model_dir``, in float32, shrunk."""
    return DemoContext(
        model=str(model_dir),
        dtype="float32",
        seed=3,
        sizes=SHRUNK_SIZES[name],
    )
