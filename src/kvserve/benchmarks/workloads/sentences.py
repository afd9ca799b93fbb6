"""Sentences for the embedding benchmark: seeded prose of 10 to 60 words each, no downloads."""

from __future__ import annotations

import random

from kvserve.benchmarks.workloads.text import random_words


def embedding_sentences(num: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """``num`` texts of ``min_words`` to ``max_words`` words (uniform), the same for a seed."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    rng = random.Random(f"embed-{seed}")
    return [random_words(rng, rng.randint(min_words, max_words)) for _ in range(num)]
