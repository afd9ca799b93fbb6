"""The interface every speculative proposer offers the scheduler.

Three methods fill it (``speculative_config.method``): prompt lookup
(``ngram_proposer.py``), suffix decoding (``suffix_proposer.py``), and a
draft model (``engine/draft_proposer.py``, built by the engine because it
runs a model; the scheduler stays free of tensors). The scheduler asks for
proposals of a request about to decode, and says when a request ends, so
that a proposer keeping state per request can drop it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Guesses at a request's next tokens, which the target model then verifies."""

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` guesses at what follows ``token_ids`` (the request's
        prompt and output so far, which only ever grows); [] for none."""
        ...

    def finish_request(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """The request ended with these output tokens (none when they should not be
        learnt from); forget what is kept for it."""
        ...

    def forget_outputs(self) -> None:
        """Forget what finished requests' outputs taught, as after a fresh start (the
        benchmarks' repetitions: an answer must not be guessed from its own last run)."""
        ...
