"""A small engine and a workload for the KV cache events tests in engine/."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kvserve import SamplingParams
from kvserve.engine import LLMEngine

BLOCK_SIZE = 4
# Small enough that a handful of distinct prompts evict each other's blocks.
NUM_BLOCKS = 24
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_engine(model_dir: Path, **engine_args: Any) -> LLMEngine:
    return LLMEngine.from_engine_args(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_seqs=2,
        **engine_args,
    )


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts with shared prefixes (hits) and distinct ones (evictions)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(2 * BLOCK_SIZE)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 10))]]
    prompts += [[rng.randrange(3, 300) for _ in range(rng.randrange(9, 20))] for _ in range(8)]
    prompts.append(shared + [rng.randrange(3, 300) for _ in range(5)])
    return prompts
