"""Prompt lookup: propose the tokens that followed the last n-gram earlier in the sequence.

Output often repeats what the context already holds (a document quoted, code
rewritten with one name changed, a JSON form filled in). When the request's
last ``n`` tokens also occur earlier in its prompt or output, the tokens that
followed that earlier occurrence are a cheap guess at what comes next; the
model checks the guess in the next step (``core/scheduler.py`` schedules the
proposals as extra query tokens, the sampler verifies them).

Longer n-grams are tried first (``prompt_lookup_max`` down to
``prompt_lookup_min``): a longer match is better evidence. Among the earlier
occurrences of one n-gram the latest that is followed by a full
``num_speculative_tokens`` is taken (the most recent context predicts best);
when none is, the earliest, which has the longest continuation.

Plain numpy on the token ids: no tensors, and no Python loop over positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposals from the request's own tokens (see the module docstring).

    min_n, max_n: the shortest and longest n-gram matched.
    max_context: only the last this many tokens are searched, which bounds
        the work per request and step on very long contexts.
    """

    def __init__(self, min_n: int, max_n: int, max_context: int = 8192) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_context = max_context

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` proposed continuations of ``token_ids``; [] when nothing matches.

        Every call searches afresh: nothing is kept per request (``request_id`` is
        part of the proposers' common interface, ``core/proposer.py``).
        """
        if num_tokens < 1 or len(token_ids) < self.min_n + 1:
            return []
        context = np.asarray(token_ids[-self.max_context :], dtype=np.int64)
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every n-gram that ends before the
            # last token, so the suffix never matches itself.
            windows = sliding_window_view(context[: length - 1], n)
            starts = np.flatnonzero((windows == context[length - n :]).all(axis=1))
            if len(starts) == 0:
                continue
            # A continuation may run into the suffix itself (a repeating pattern).
            full = starts[starts + n + num_tokens <= length]
            start = int(full[-1]) if len(full) else int(starts[0])
            begin = start + n
            return context[begin : begin + num_tokens].tolist()
        return []

    def finish_request(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """Nothing to forget: no state is kept per request."""

    def forget_outputs(self) -> None:
        """Nothing to forget: proposals come from the request's own tokens alone."""
