"""Every benchmark's prompts, from the seeded text of :mod:`.text`: token ids or words.

- Token ids of an exact length, for benchmarks that drive kvserve's engine (or
  a baseline) with the model's tokenizer at hand: :func:`prompts_of_lengths`
  (English passages, the engine benchmarks' workloads and the demos') and
  :func:`random_token_ids` (prose, where prompts must share nothing by chance:
  the prefix and structured-output benchmarks).
- Words, for HTTP clients that have no tokenizer (the server may run any
  model): :func:`make_prompts` builds ``kvserve bench serve``'s rounds,
  distinct or behind shared system prompts, asking for lengths in tokens and
  drawing them in words at the prose's measured rate (:func:`approx_words`).

The same arguments and seed give the same prompts on every run and machine,
so every engine under comparison, and every run of a recorded figure, sees
the same work.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.benchmarks.workloads.text import passage, random_text, random_words
from kvserve.errors import InvalidParameterError


class Tokenizer(Protocol):
    """The one tokenizer method used here (transformers' tokenizers and FastTokenizer have it)."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...


def prompts_of_lengths(tokenizer: Tokenizer, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """One prompt of English text of each requested length in tokens, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [_english_token_ids(tokenizer, rng, num_tokens) for num_tokens in lengths]


def _english_token_ids(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    """Exactly ``num_tokens`` token ids of English passages, each encoded alone, cut to length."""
    token_ids: list[int] = []
    while len(token_ids) < num_tokens:
        token_ids.extend(tokenizer.encode(passage(rng, 8), add_special_tokens=False))
    return token_ids[:num_tokens]


def random_token_ids(tokenizer: Tokenizer, num_tokens: int, rng: random.Random) -> list[int]:
    """Exactly ``num_tokens`` token ids of seeded prose (no special tokens).

    Text is generated until it tokenizes to at least ``num_tokens`` tokens,
    then cut; the cut may fall inside a word, which a benchmark does not mind.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    sentences: list[str] = []
    token_ids: list[int] = []
    while len(token_ids) < num_tokens:
        # Roughly 15 tokens a sentence: add enough for the shortfall in one go.
        sentences.append(random_text(rng, max(1, (num_tokens - len(token_ids)) // 12)))
        token_ids = tokenizer.encode("\n\n".join(sentences), add_special_tokens=False)
    return token_ids[:num_tokens]


@dataclass(frozen=True)
class Prompt:
    """One request's text: an optional system prompt (shared between requests) and its own."""

    system: str | None
    user: str

    @property
    def text(self) -> str:
        """The whole prompt as one string, for ``/completions``."""
        return self.user if self.system is None else f"{self.system}\n\n{self.user}"


PROMPT_KINDS = ("distinct", "shared-prefix")
# Tokens per word of the prose, measured with SmolLM2's tokenizer (2,755
# tokens for 2,366 words); other vocabularies differ somewhat.
TOKENS_PER_WORD = 1.16


def approx_words(num_tokens: int) -> int:
    """How many words of the prose make about ``num_tokens`` tokens."""
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
    """The prompts of one ``kvserve bench serve`` round (``"warmup"``, ``"run-0"``, ...).

    Reproducible from ``seed`` and ``round_name``. num_prefixes: shared-prefix
    only: system prompts to draw each request's from.
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
