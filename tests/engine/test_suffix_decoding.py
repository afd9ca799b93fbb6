"""Suffix-decoding proposals never change what SmolLM2 generates greedily, and help later requests.

As in test_speculative_decoding.py, each scenario runs on an engine without
speculation (the reference) and one with ``method: "suffix"``; greedy
tokens must agree, a divergence tolerated only at a genuine near-tie of two
tokens (a verification row and a decode row are computed on different
paths). The counters must show accepted proposals where the output repeats
its context, so that the comparison means something.

The weights are dequantized (``quantization="none"``, float32) for the same
reason as there: the GGUF's quantized product rounds activations differently
with the number of rows in a step, so a token computed in a verification
chunk and the same token computed by a plain decode already differ by ~5e-2
in logprob without any error; that would turn near-ties into divergences
and hide real errors.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_speculative_decoding import (
    BLOCK_SIZE,
    CODE,
    FREE,
    MODEL,
    assert_pool_whole,
    assert_same_tokens,
    completions,
    counters,
    greedy,
)

from kvserve import LLM
from kvserve.core.suffix_proposer import SuffixProposer

# Every decoding request proposes (not adaptive): what the tests count never depends
# on how long steps took.
SPEC = {
    "method": "suffix",
    "num_speculative_tokens": 6,
    "suffix_decoding_max_tree_depth": 16,
    "adaptive": False,
}


def make_llm(speculative: bool) -> LLM:
    args: dict[str, Any] = dict(
        dtype="float32", quantization="none", block_size=BLOCK_SIZE, num_blocks=128
    )
    if speculative:
        args["speculative_config"] = SPEC
    return LLM(MODEL, **args)


@pytest.fixture(scope="module")
def reference() -> LLM:
    return make_llm(False)


def proposer_of(llm: LLM) -> SuffixProposer:
    proposer = llm.llm_engine.scheduler.proposer
    assert isinstance(proposer, SuffixProposer)
    return proposer


def test_greedy_output_is_unchanged_with_and_without_repetition(reference: LLM) -> None:
    speculative = make_llm(True)
    for prompt, repeats in ((CODE, True), (FREE, False)):
        (want,) = completions(reference, [prompt], greedy(40))
        _, accepted_before = counters(speculative)
        (got,) = completions(speculative, [prompt], greedy(40))
        assert_same_tokens(want, got, prompt[:20])
        accepted = counters(speculative)[1] - accepted_before
        if repeats:
            assert accepted > 10  # the renamed function is mostly guessed from the prompt
    assert proposer_of(speculative).request_counts == {}  # freed as each request ended
    assert_pool_whole(speculative)


def test_a_repeated_request_is_guessed_from_the_first_ones_output(reference: LLM) -> None:
    speculative = make_llm(True)
    (want,) = completions(reference, [FREE], greedy(40))
    accepted = []
    for _ in range(2):
        _, before = counters(speculative)
        (got,) = completions(speculative, [FREE], greedy(40))
        assert_same_tokens(want, got, "repeat")
        accepted.append(counters(speculative)[1] - before)
    assert len(proposer_of(speculative).cached_outputs) == 2
    # The second run finds the first's output in the store: most of it is accepted.
    assert accepted[1] > accepted[0]
    assert accepted[1] >= len(want.token_ids) // 2
    assert_pool_whole(speculative)
