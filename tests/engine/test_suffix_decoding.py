"""Suffix-decoding proposals never change what a model generates greedily, and help later
requests.

As in test_speculative_decoding.py, each scenario runs on an engine without
speculation (the reference) and one with ``method: "suffix"``; greedy
tokens must agree, a divergence tolerated only at a genuine near-tie of two
tokens (a verification row and a decode row are computed on different
paths). The counters must show accepted proposals, so that the comparison
means something.

The model is the tiny random Llama (``tiny_model_dir``), for the reason given
there: verification does not depend on the weights, and a random model's greedy
output loops, which the suffix tree of its own output guesses. SmolLM2's
end-to-end check is test_speculative_decoding.py's; the proposer's tree
itself is tested in tests/unit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_speculative_decoding import LOOPING, NEAR_TIE, RAMBLING

from greedy_checks import assert_pool_whole, assert_same_tokens, completions, greedy, spec_counters
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


def make_llm(model_dir: Path, speculative: bool) -> LLM:
    args: dict[str, Any] = dict(dtype="float32", block_size=4, num_blocks=256)
    if speculative:
        args["speculative_config"] = SPEC
    return LLM(str(model_dir), **args)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, False)


def proposer_of(llm: LLM) -> SuffixProposer:
    proposer = llm.llm_engine.scheduler.proposer
    assert isinstance(proposer, SuffixProposer)
    return proposer


def test_greedy_output_is_unchanged(tiny_model_dir: Path, reference: LLM) -> None:
    speculative = make_llm(tiny_model_dir, True)
    for label, prompt in (("looping", LOOPING), ("rambling", RAMBLING)):
        (want,) = completions(reference, [prompt], greedy(40, ignore_eos=True))
        proposed_before, accepted_before = spec_counters(speculative)
        (got,) = completions(speculative, [prompt], greedy(40, ignore_eos=True))
        assert_same_tokens(want, got, label, NEAR_TIE)
        proposed, accepted = spec_counters(speculative)
        assert proposed > proposed_before, label
        if prompt is LOOPING:
            # Its loops are mostly guessed, and some guesses fail.
            assert proposed - proposed_before > accepted - accepted_before > 10
    assert proposer_of(speculative).request_counts == {}  # freed as each request ended
    assert_pool_whole(speculative)


def test_a_repeated_request_is_guessed_from_the_first_ones_output(
    tiny_model_dir: Path, reference: LLM
) -> None:
    speculative = make_llm(tiny_model_dir, True)
    (want,) = completions(reference, [RAMBLING], greedy(40, ignore_eos=True))
    accepted = []
    for _ in range(2):
        _, before = spec_counters(speculative)
        (got,) = completions(speculative, [RAMBLING], greedy(40, ignore_eos=True))
        assert_same_tokens(want, got, "repeat", NEAR_TIE)
        accepted.append(spec_counters(speculative)[1] - before)
    assert len(proposer_of(speculative).cached_outputs) == 2
    # The second run finds the first's output in the store: most of it is accepted.
    assert accepted[1] > accepted[0]
    assert accepted[1] >= len(want.token_ids) // 2
    assert_pool_whole(speculative)
    # Once the engine forgets finished outputs, a third run guesses as the first did.
    speculative.llm_engine.forget_speculation_outputs()
    assert len(proposer_of(speculative).cached_outputs) == 0
    _, before = spec_counters(speculative)
    (got,) = completions(speculative, [RAMBLING], greedy(40, ignore_eos=True))
    assert_same_tokens(want, got, "after forgetting", NEAR_TIE)
    assert spec_counters(speculative)[1] - before < accepted[1]
