"""Suffix decoding: propose the continuation seen most often after the context's longest suffix.

Prompt lookup (``ngram_proposer.py``) takes the tokens after one earlier
occurrence of the last n-gram. Suffix decoding counts every occurrence, in
two places, and follows the most frequent next token:

- each running request's own prompt and output, indexed as its tokens
  arrive and dropped when it ends;
- the outputs of the last ``max_cached_requests`` finished requests, so a
  request that writes what an earlier one wrote (the same form, the same
  answer) is guessed from that output. The store forgets the least
  recently finished request first, which bounds its memory.

Both are :class:`NgramCounts`: a dict from each n-gram (n = 1 ..
``max_depth``) to how often each token followed it. Each proposed token
comes from the longest suffix of the context (with the tokens proposed so
far) that the request's own index or the store holds; the request's own
index wins a tie of lengths, as its own text predicts it best. The most
frequent next token is proposed while its share of that suffix's
continuations is at least ``min_token_prob``; ties go to the smallest token
id so that proposals do not depend on dict order.

Indexing a token costs ``max_depth`` dict updates and lookups stay at about
``log2(max_depth)`` per proposed token (any suffix of a seen n-gram was seen
too, so the longest match is found by bisection). Memory is about
``max_depth`` entries per indexed token, which is why the store is bounded
by requests and the depth by the config.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NgramCounts:
    """Counts of the token that followed each n-gram (1 <= n <= max_depth) of some sequences.

    Most long n-grams occur once, so a gram followed once by one token maps
    to that token alone (an int); only grams seen more often get a dict of
    counts. That halves the memory of a long request's counts.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counts: dict[tuple[int, ...], int | dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.counts)

    def add(self, tokens: Sequence[int], start: int = 0, sign: int = 1) -> None:
        """Count ``tokens[i]`` after each n-gram ending at i, for i from ``start`` on.

        ``sign=-1`` takes the same counts away (a sequence leaving the store).
        """
        counts = self.counts
        sequence = tuple(tokens)  # a tuple's slice is the gram itself: no list in between
        for position in range(max(start, 1), len(sequence)):
            token = sequence[position]
            for n in range(1, min(self.max_depth, position) + 1):
                gram = sequence[position - n : position]
                followers = counts.get(gram)
                if followers is None:
                    if sign > 0:
                        counts[gram] = token
                    continue
                if not isinstance(followers, dict):
                    if sign < 0:
                        if followers == token:
                            del counts[gram]
                        continue
                    followers = counts[gram] = {followers: 1}
                count = followers.get(token, 0) + sign
                if count > 0:
                    followers[token] = count
                else:
                    followers.pop(token, None)
                    if not followers:
                        del counts[gram]

    def longest_match(self, context: Sequence[int]) -> int:
        """The length of the longest suffix of ``context`` that has a counted continuation (0: none)."""
        low, high = 0, min(self.max_depth, len(context))
        end = len(context)
        while low < high:  # the longest n in (low, high] whose gram is known; known n are a prefix
            middle = (low + high + 1) // 2
            if tuple(context[end - middle : end]) in self.counts:
                low = middle
            else:
                high = middle - 1
        return low

    def best_next(self, context: Sequence[int], n: int) -> tuple[int, float]:
        """The most frequent token after the last ``n`` tokens of ``context``, and its share."""
        followers = self.counts[tuple(context[len(context) - n :])]
        if not isinstance(followers, dict):
            return followers, 1.0
        token, count = min(followers.items(), key=lambda item: (-item[1], item[0]))
        return token, count / sum(followers.values())

    def followers(self, gram: tuple[int, ...]) -> dict[int, int]:
        """How often each token followed ``gram`` ({} if never)."""
        followers = self.counts.get(gram)
        if followers is None:
            return {}
        return dict(followers) if isinstance(followers, dict) else {followers: 1}


class SuffixProposer:
    """Proposals from each request's own tokens and from recent outputs (see the module docstring).

    max_depth: the longest suffix matched (``suffix_decoding_max_tree_depth``).
    max_cached_requests: finished outputs kept for other requests (0: none).
    min_token_prob: the least share of its suffix's continuations a proposed
        token must have.
    """

    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        if max_depth < 1 or max_cached_requests < 0 or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(
                f"need max_depth >= 1, max_cached_requests >= 0, 0 <= min_token_prob <= 1; got "
                f"{max_depth}, {max_cached_requests}, {min_token_prob}"
            )
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        # Per running request: its counts and how many of its tokens they hold.
        self.request_counts: dict[str, tuple[NgramCounts, list[int]]] = {}
        self.global_counts = NgramCounts(max_depth)
        self.cached_outputs: OrderedDict[str, list[int]] = OrderedDict()

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` guesses at what follows ``token_ids``; [] when nothing matches.

        ``token_ids`` only ever grows for one request (rejected proposals are
        never appended), so the tokens new since the last call are indexed.
        """
        own = self._index(request_id, token_ids)
        context = list(token_ids[-self.max_depth :])
        proposals: list[int] = []
        while len(proposals) < num_tokens:
            own_n = own.longest_match(context)
            global_n = self.global_counts.longest_match(context)
            if own_n == 0 and global_n == 0:
                break
            source = own if own_n >= global_n else self.global_counts
            token, share = source.best_next(context, max(own_n, global_n))
            if share < self.min_token_prob:
                break
            proposals.append(token)
            context.append(token)
            if len(context) > self.max_depth:
                del context[0]
        return proposals

    def _index(self, request_id: str, token_ids: Sequence[int]) -> NgramCounts:
        entry = self.request_counts.get(request_id)
        if entry is None:
            entry = self.request_counts[request_id] = (NgramCounts(self.max_depth), [0])
        counts, num_indexed = entry
        if num_indexed[0] < len(token_ids):
            counts.add(token_ids, num_indexed[0])
            num_indexed[0] = len(token_ids)
        return counts

    def forget_outputs(self) -> None:
        """Empty the store of finished outputs (running requests keep their own counts)."""
        self.cached_outputs.clear()
        self.global_counts = NgramCounts(self.max_depth)

    def finish_request(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """Drop the request's own counts; keep its output (if any) for later requests."""
        self.request_counts.pop(request_id, None)
        if self.max_cached_requests == 0 or len(output_token_ids) < 2:
            return  # one token has no n-gram before it: nothing to count
        previous = self.cached_outputs.pop(request_id, None)
        if previous is not None:  # an id used again: its newest output replaces the old one
            self.global_counts.add(previous, sign=-1)
        output = list(output_token_ids)
        self.cached_outputs[request_id] = output
        self.global_counts.add(output)
        while len(self.cached_outputs) > self.max_cached_requests:
            _, evicted = self.cached_outputs.popitem(last=False)
            self.global_counts.add(evicted, sign=-1)
