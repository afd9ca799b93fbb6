"""The prompt-lookup proposer against a plain-Python search of the same rule."""

from __future__ import annotations

import random

import pytest

from kvserve.core.ngram_proposer import NgramProposer


def reference_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest n first; the latest earlier match followed by k tokens, else the earliest."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        starts = [i for i in range(length - n) if tokens[i : i + n] == suffix]
        if not starts:
            continue
        full = [i for i in starts if i + n + k <= length]
        start = full[-1] if full else starts[0]
        return tokens[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_earlier_occurrence() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    tokens = [5, 6, 7, 8, 9, 10, 1, 2, 6, 7]
    assert proposer.propose("r", tokens, 3) == [8, 9, 10]


def test_longer_ngram_wins_over_a_later_shorter_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    # "1 2 3" occurs at 0 (followed by 40); "2 3" alone also at 5 (followed by 50).
    tokens = [1, 2, 3, 40, 41, 2, 3, 50, 51, 9, 1, 2, 3]
    assert proposer.propose("r", tokens, 2) == [40, 41]


def test_no_match_and_short_sequences_propose_nothing() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose("r", [1, 2, 3, 4, 5, 6], 3) == []
    assert proposer.propose("r", [1, 2], 3) == []
    assert proposer.propose("r", [1, 2, 1, 2], 0) == []


def test_repeating_pattern_continues_into_the_suffix() -> None:
    proposer = NgramProposer(min_n=1, max_n=2)
    assert proposer.propose("r", [7, 8, 7, 8, 7, 8], 4) == [7, 8, 7, 8]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_reference_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(2, 80))]
    min_n = rng.randrange(1, 4)
    max_n = rng.randrange(min_n, 6)
    k = rng.randrange(1, 7)
    proposer = NgramProposer(min_n, max_n)
    assert proposer.propose("r", tokens, k) == reference_proposal(tokens, k, min_n, max_n)


def test_only_the_recent_context_is_searched() -> None:
    proposer = NgramProposer(min_n=2, max_n=2, max_context=6)
    tokens = [1, 2, 99] + [0] * 10 + [3, 4, 1, 2]
    assert proposer.propose("r", tokens, 1) == []  # the match at 0 is outside the last 6 tokens
