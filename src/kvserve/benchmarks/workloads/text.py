"""Seeded English-like text for benchmark prompts, generated on the spot (no downloads).

Sentences are drawn from a small built-in vocabulary with a seeded
``random.Random``, so every run, machine and engine under comparison sees
exactly the same prompts. The text reads like plausible prose to a tokenizer
(common words, punctuation, capitals), which keeps tokens-per-word realistic;
it is not meant to make sense.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_DETERMINERS = _words("the a this that every each some no one another")
_ADJECTIVES = _words(
    "small large quiet bright old new early late simple careful quick slow warm cold "
    "clear dark heavy light open narrow wide busy empty green blue red golden silver "
    "strange familiar useful patient honest curious gentle loud sudden distant local "
    "modern ancient rough smooth tired eager"
)
_NOUNS = _words(
    "engine river garden window teacher student city village road bridge market "
    "question answer letter story book table kitchen mountain forest ocean island "
    "machine computer program model memory block cache request server client doctor "
    "farmer painter musician child family friend neighbour storm morning evening "
    "winter summer season light shadow voice idea plan problem reason result moment "
    "door wall field station train ship planet star paper pencil lamp clock"
)
_VERBS = _words(
    "finds builds opens carries watches follows answers writes reads remembers "
    "forgets explains measures paints repairs visits crosses leaves joins keeps "
    "changes moves checks holds shares counts sends receives describes improves "
    "protects discovers collects teaches learns"
)
_ADVERBS = _words(
    "slowly quickly quietly carefully often rarely always suddenly gently clearly "
    "again together later soon nearly almost"
)
_PREPOSITIONS = _words("near behind under over beside across through around toward after before")
_CONNECTIVES = _words("and but so because while although when")


class Tokenizer(Protocol):
    """The one tokenizer method used here (Hugging Face tokenizers have it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def _choice(rng: random.Random, words: Sequence[str]) -> str:
    return words[rng.randrange(len(words))]


def _noun_phrase(rng: random.Random) -> str:
    words = [_choice(rng, _DETERMINERS)]
    if rng.random() < 0.6:
        words.append(_choice(rng, _ADJECTIVES))
    words.append(_choice(rng, _NOUNS))
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    words = [_noun_phrase(rng)]
    if rng.random() < 0.3:
        words.append(_choice(rng, _ADVERBS))
    words += [_choice(rng, _VERBS), _noun_phrase(rng)]
    if rng.random() < 0.5:
        words += [_choice(rng, _PREPOSITIONS), _noun_phrase(rng)]
    return " ".join(words)


def random_sentence(rng: random.Random) -> str:
    """One sentence of one or two clauses, capitalised, ending in a full stop."""
    sentence = _clause(rng)
    if rng.random() < 0.4:
        sentence += f", {_choice(rng, _CONNECTIVES)} {_clause(rng)}"
    return sentence[0].upper() + sentence[1:] + "."


def random_text(rng: random.Random, num_sentences: int) -> str:
    """``num_sentences`` sentences in paragraphs of three to six."""
    paragraphs: list[str] = []
    remaining = num_sentences
    while remaining > 0:
        count = min(remaining, rng.randint(3, 6))
        paragraphs.append(" ".join(random_sentence(rng) for _ in range(count)))
        remaining -= count
    return "\n\n".join(paragraphs)


def random_words(rng: random.Random, num_words: int) -> str:
    """Exactly ``num_words`` words of seeded prose, on one line; the last sentence may be cut.

    For clients that have no tokenizer (``kvserve bench serve`` measures other
    servers too), where a prompt's length can only be asked for in words.
    """
    if num_words < 1:
        raise ValueError(f"num_words must be >= 1, got {num_words}")
    words: list[str] = []
    while len(words) < num_words:
        words += random_sentence(rng).split()
    return " ".join(words[:num_words])


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
