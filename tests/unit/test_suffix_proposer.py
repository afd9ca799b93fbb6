"""The suffix-decoding proposer against a brute-force search of the same rules."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.core.suffix_proposer import NgramCounts, SuffixProposer


def occurrences(
    sequences: list[list[int]], context: list[int], max_depth: int
) -> tuple[int, Counter[int]]:
    """Longest suffix of ``context`` (<= max_depth) followed by a token somewhere; what followed."""
    for n in range(min(max_depth, len(context)), 0, -1):
        suffix = context[len(context) - n :]
        followers: Counter[int] = Counter()
        for tokens in sequences:
            for end in range(n, len(tokens)):
                if tokens[end - n : end] == suffix:
                    followers[tokens[end]] += 1
        if followers:
            return n, followers
    return 0, Counter()


def reference_proposal(
    own: list[int],
    finished: list[list[int]],
    k: int,
    max_depth: int,
    min_prob: float,
) -> list[int]:
    """Token by token: the longer match (own wins ties), its most frequent follower (smallest id)."""
    context = list(own)
    proposals: list[int] = []
    while len(proposals) < k:
        own_n, own_followers = occurrences([own], context, max_depth)
        global_n, global_followers = occurrences(finished, context, max_depth)
        if own_n == 0 and global_n == 0:
            break
        followers = own_followers if own_n >= global_n else global_followers
        token = min(followers, key=lambda t: (-followers[t], t))
        if followers[token] / sum(followers.values()) < min_prob:
            break
        proposals.append(token)
        context.append(token)
    return proposals


def normalized(counts: NgramCounts) -> dict[tuple[int, ...], dict[int, int]]:
    return {gram: counts.followers(gram) for gram in counts.counts}


def test_follows_the_most_frequent_continuation() -> None:
    proposer = SuffixProposer(max_depth=4, max_cached_requests=0, min_token_prob=0.0)
    # After "1 2": 3 twice, 9 once; after "1 2 3": 4 both times; after "1 2 3 4":
    # 1 and 7 once each, a tie the smaller id wins.
    tokens = [1, 2, 3, 4, 1, 2, 9, 5, 1, 2, 3, 4, 7, 1, 2]
    assert proposer.propose("a", tokens, 3) == [3, 4, 1]


def test_longer_match_wins_over_a_more_frequent_shorter_one() -> None:
    proposer = SuffixProposer(max_depth=4, max_cached_requests=0, min_token_prob=0.0)
    # "5 1 2" was followed by 8 once; "1 2" alone is followed by 3 more often.
    tokens = [5, 1, 2, 8, 1, 2, 3, 0, 1, 2, 3, 0, 5, 1, 2]
    assert proposer.propose("a", tokens, 1) == [8]


def test_min_token_prob_stops_uncertain_guesses() -> None:
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # after "1 2": 3, 4, 5 once each
    assert SuffixProposer(4, 0, 0.5).propose("a", tokens, 3) == []
    assert SuffixProposer(4, 0, 0.3).propose("a", tokens, 1) == [3]


def test_own_context_wins_a_tie_and_the_store_a_longer_match() -> None:
    proposer = SuffixProposer(max_depth=8, max_cached_requests=4, min_token_prob=0.0)
    proposer.finish_request("done", [7, 1, 2, 30, 31, 32])
    # Own "1 2" -> 20 ties the store's "1 2" -> 30 in length: own wins.
    assert proposer.propose("a", [1, 2, 20, 21, 1, 2], 1) == [20]
    # The store holds "7 1 2", longer than anything of the request's own.
    assert proposer.propose("b", [1, 2, 20, 7, 1, 2], 3) == [30, 31, 32]


def test_unknown_context_proposes_nothing() -> None:
    proposer = SuffixProposer(max_depth=4, max_cached_requests=4, min_token_prob=0.1)
    assert proposer.propose("a", [1, 2, 3, 4], 3) == []
    assert proposer.propose("b", [], 3) == []
    assert proposer.propose("c", [5, 5], 0) == []


@pytest.mark.parametrize("seed", range(30))
def test_matches_the_reference_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 12])
    max_depth = rng.choice([1, 2, 3, 5, 8])
    min_prob = rng.choice([0.0, 0.1, 0.4, 0.7])
    max_cached = rng.choice([0, 1, 3])
    proposer = SuffixProposer(max_depth, max_cached, min_prob)
    finished: list[list[int]] = []
    for index in range(rng.randrange(0, 5)):
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        proposer.finish_request(f"old-{index}", output)
        if len(output) >= 2 and max_cached:
            finished = [*finished, output][-max_cached:]
    # Evicted outputs are taken away exactly: the store counts what a fresh one would.
    fresh = NgramCounts(max_depth)
    for output in finished:
        fresh.add(output)
    assert normalized(proposer.global_counts) == normalized(fresh)
    # One request growing token by token, asked at each length (indexing is incremental).
    own = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
    for _ in range(40):
        k = rng.randrange(1, 6)
        want = reference_proposal(own, finished, k, max_depth, min_prob)
        assert proposer.propose("live", own, k) == want, (own, finished)
        own.append(rng.randrange(vocab))


def test_store_forgets_the_oldest_request_beyond_its_bound() -> None:
    proposer = SuffixProposer(max_depth=3, max_cached_requests=2, min_token_prob=0.0)
    proposer.finish_request("r0", [100, 101, 102])
    proposer.finish_request("r1", [200, 201, 202])
    assert proposer.propose("x", [100], 2) == [101, 102]
    proposer.finish_request("r2", [300, 301, 302])
    assert list(proposer.cached_outputs) == ["r1", "r2"]
    assert proposer.propose("y", [100], 2) == []  # r0's counts are gone
    assert proposer.propose("z", [200], 2) == [201, 202]
    # Counts equal those of the two kept outputs alone: nothing of r0 lingers.
    fresh = NgramCounts(3)
    fresh.add([200, 201, 202])
    fresh.add([300, 301, 302])
    assert normalized(proposer.global_counts) == normalized(fresh)


def test_memory_stays_bounded_over_many_requests() -> None:
    rng = random.Random(0)
    proposer = SuffixProposer(max_depth=4, max_cached_requests=5, min_token_prob=0.1)
    sizes = []
    for index in range(200):
        proposer.finish_request(str(index), [rng.randrange(50) for _ in range(20)])
        sizes.append(len(proposer.global_counts))
    assert len(proposer.cached_outputs) == 5
    # At most 5 outputs x 19 positions x 4 n-grams each.
    assert max(sizes) <= 5 * 19 * 4


def test_request_counts_are_freed_on_finish() -> None:
    proposer = SuffixProposer(max_depth=4, max_cached_requests=0, min_token_prob=0.1)
    proposer.propose("a", [1, 2, 1, 2], 2)
    proposer.propose("b", [3, 4, 3], 2)
    assert set(proposer.request_counts) == {"a", "b"}
    proposer.finish_request("a", [1, 2])
    proposer.finish_request("b")  # aborted before any output
    proposer.finish_request("never-scheduled")
    assert proposer.request_counts == {}
    assert proposer.cached_outputs == {}  # max_cached_requests=0 keeps nothing


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        SuffixProposer(0, 1, 0.1)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixProposer(4, 1, 1.5)


def test_forgetting_outputs_empties_the_store_and_keeps_running_requests() -> None:
    proposer = SuffixProposer(max_depth=3, max_cached_requests=4, min_token_prob=0.0)
    proposer.finish_request("done", [100, 101, 102])
    assert proposer.propose("live", [7, 8, 7], 1) == [8]  # its own counts
    assert proposer.propose("other", [100], 2) == [101, 102]  # the store's
    proposer.forget_outputs()
    assert proposer.cached_outputs == {} and len(proposer.global_counts) == 0
    assert proposer.propose("other", [100], 2) == []
    assert proposer.propose("live", [7, 8, 7], 1) == [8]  # a running request keeps its own
