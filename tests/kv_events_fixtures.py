"""A small engine, a workload and a subscription check for the KV cache events tests."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from kvserve import SamplingParams
from kvserve.core.kv_events import KVEventBatch
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


def wait_until_subscribed(sub: Any, publisher: Any, timeout: float = 10.0) -> int:
    """Publish empty batches on ``publisher`` until ``sub`` gets them; how many were sent.

    A SUB socket misses what is published before its subscription has reached
    the PUB socket, which on a loaded machine can take longer than any fixed
    pause. A probe that arrives proves the subscription is in place; the ones
    after it are read here, so the next message ``sub`` reads is the first
    batch published after this call, whose sequence number is the count returned.
    """
    deadline = time.monotonic() + timeout
    sent = 0
    while True:
        publisher.publish(KVEventBatch(time.time(), ()))
        sent += 1
        if sub.poll(100):
            break
        assert time.monotonic() < deadline, "the SUB socket never received a probe"
    while True:  # every probe after the first one received arrives, in order
        assert sub.poll(5000), "a probe published after the subscription was lost"
        _, seq, _ = sub.recv_multipart()
        if int.from_bytes(seq, "big") == sent - 1:
            return sent
