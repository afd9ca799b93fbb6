"""``kvserve bench serve``'s prompts: seeded prose, distinct or behind shared system prompts.

The client has no tokenizer (the server may run any model), so lengths are
asked for in tokens and drawn in words, at the generator's measured rate.
"""

from __future__ import annotations

import random

from kvserve.benchmarks.online.serve_client import Prompt
from kvserve.benchmarks.workloads.text import random_words
from kvserve.errors import InvalidParameterError

PROMPT_KINDS = ("distinct", "shared-prefix")
# Tokens per word of the text generator's prose, measured with SmolLM2's
# tokenizer (2,755 tokens for 2,366 words); other vocabularies differ somewhat.
TOKENS_PER_WORD = 1.16


def approx_words(num_tokens: int) -> int:
    """How many words of the generator's prose make about ``num_tokens`` tokens."""
    return max(1, round(num_tokens / TOKENS_PER_WORD))


def make_prompts(
    kind: str,
    num_requests: int,
    prompt_tokens: int,
    shared_prefix_tokens: int,
    seed: int,
    round_name: str,
    num_prefixes: int = 1,
) -> list[Prompt]:
    """The prompts of one round (``"warmup"``, ``"run-0"``, ...), reproducible from ``seed``.

    num_prefixes: shared-prefix only: system prompts to draw each request's from.
    """
    if kind not in PROMPT_KINDS:
        raise InvalidParameterError("prompt_kind", f"must be one of {PROMPT_KINDS}, got {kind!r}")
    # A string seed is hashed with SHA-512: the same prompts in every process.
    rng = random.Random(f"kvserve-bench-serve/{seed}/{round_name}")
    if kind == "distinct":
        systems: list[str | None] = [None]
    else:
        words = approx_words(shared_prefix_tokens)
        systems = [random_words(rng, words) for _ in range(num_prefixes)]
    prompts = []
    for _ in range(num_requests):
        # One prefix draws nothing: the prompts stay those of before --num-prefixes.
        system = systems[0] if len(systems) == 1 else systems[rng.randrange(len(systems))]
        prompts.append(Prompt(system, random_words(rng, approx_words(prompt_tokens))))
    return prompts
