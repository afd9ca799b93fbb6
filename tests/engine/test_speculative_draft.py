"""Speculative decoding with a draft model (``method: "draft_model"``), on tiny random models.

The reference for greedy output is the same target without speculation;
a divergence is tolerated only at a genuine near-tie (as in
test_speculative_tiny.py). A model drafting for itself proposes the tokens
the target then picks, so (near) every proposal is accepted: a check that
the draft sees the request's exact context and positions. Both engines' KV
pools must be whole at the end: the target's, and the draft's own.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from greedy_checks import assert_same_tokens, completions, greedy
from kvserve import LLM, SamplingParams
from kvserve.engine.draft_proposer import DraftModelProposer, check_same_vocabulary
from kvserve.errors import InvalidParameterError
from kvserve.outputs import CompletionOutput
from model_fixtures import save_tiny_model, train_tiny_tokenizer

NEAR_TIE = 1e-4
BASE_ARGS: dict[str, Any] = dict(dtype="float32", block_size=4, num_blocks=256)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tiny_tokenizer()
    target = save_tiny_model(tmp_path_factory.mktemp("target"), "llama", tokenizer)
    # Another model of the same tokenizer: other weights, one layer.
    other = save_tiny_model(
        tmp_path_factory.mktemp("other"), "llama", tokenizer, seed=1, num_hidden_layers=1
    )
    tokenizer.add_tokens(["<extra-token>"])
    foreign = save_tiny_model(tmp_path_factory.mktemp("foreign"), "llama", tokenizer)
    return {"target": target, "other": other, "foreign": foreign}


def spec(draft: Path, k: int = 4) -> dict[str, Any]:
    # Not adaptive: every decoding request proposes, whatever the steps cost.
    return {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": k,
        "adaptive": False,
    }


def prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(11)
    return [
        {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(3, 30))]}
        for _ in range(5)
    ]


def generate(llm: LLM) -> list[CompletionOutput]:
    return completions(llm, prompts(), greedy(24, ignore_eos=True))


def draft_of(llm: LLM) -> DraftModelProposer:
    proposer = llm.llm_engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def assert_pools_whole(llm: LLM) -> None:
    for engine in (llm.llm_engine, draft_of(llm).engine):
        kv = engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
        assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"num_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 4}],
    ids=["roomy", "chunked-and-preempted"],
)
@pytest.mark.parametrize("draft", ["target", "other"], ids=["self-draft", "other-draft"])
def test_greedy_output_is_unchanged(
    model_dirs: dict[str, Path], engine_args: dict[str, Any], draft: str
) -> None:
    args = {**BASE_ARGS, **engine_args}
    want = generate(LLM(str(model_dirs["target"]), **args))
    llm = LLM(str(model_dirs["target"]), **args, speculative_config=spec(model_dirs[draft]))
    got = generate(llm)
    for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
        assert_same_tokens(expected, actual, f"prompt {index}", NEAR_TIE)
    scheduler = llm.llm_engine.scheduler
    proposed, accepted = scheduler.num_spec_proposed_total, scheduler.num_spec_accepted_total
    assert proposed > 0
    if draft == "target":
        # The draft is the target: only a near-tie decided differently in a batch of
        # other shape may reject a proposal.
        assert accepted >= 0.95 * proposed, (accepted, proposed)
        # Each round's prompt extends an earlier one: the draft computes only the tail.
        assert draft_of(llm).engine.stats.prefix_cache_hits > 0
        # Forgetting earlier answers (the benchmarks' cold start) empties that cache.
        assert draft_of(llm).engine.kv_cache_manager.num_cached_blocks > 0
        draft_of(llm).forget_outputs()
        assert draft_of(llm).engine.kv_cache_manager.num_cached_blocks == 0
    if engine_args:
        assert scheduler.num_preemptions_total > 0
    assert_pools_whole(llm)


def test_sampled_requests_are_reproducible_with_an_adaptive_draft(
    model_dirs: dict[str, Path],
) -> None:
    """Seeded sampling verifies the draft's proposals by rejection sampling; the adaptive
    policy (the default) measures steps whose schedule ran the draft."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=5, ignore_eos=True)
    config = {**spec(model_dirs["other"]), "adaptive": True}
    runs = []
    for _ in range(2):
        llm = LLM(str(model_dirs["target"]), **BASE_ARGS, speculative_config=config)
        outputs = llm.generate(prompts()[:2], params, use_tqdm=False)  # type: ignore[arg-type]
        runs.append([output.outputs[0].token_ids for output in outputs])
        assert llm.llm_engine.scheduler.num_spec_proposed_total > 0
        assert_pools_whole(llm)
    assert runs[0] == runs[1]


def test_a_draft_with_another_vocabulary_is_refused(model_dirs: dict[str, Path]) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidParameterError, match="tokenizer differs") as caught:
        LLM(str(model_dirs["target"]), **BASE_ARGS, speculative_config=spec(model_dirs["foreign"]))
    assert caught.value.param == "speculative_config.model"
    assert "<extra-token>" in str(caught.value)
    assert time.perf_counter() - started < 30


def test_a_missing_draft_is_refused_naming_the_field(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        LLM(str(model_dirs["target"]), **BASE_ARGS, speculative_config=spec(tmp_path / "none"))
    assert caught.value.param == "speculative_config.model"


class _Vocabulary:
    """Stands for a tokenizer: the vocabulary check reads only ``get_vocab``."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_vocabulary_check_names_what_differs_and_the_lm_head() -> None:
    target = _Vocabulary({"a": 0, "b": 1, "c": 2})
    check_same_vocabulary(target, _Vocabulary({"c": 2, "b": 1, "a": 0}), 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=r"differ, e\.g\. \['b', 'd'\]") as caught:
        check_same_vocabulary(target, _Vocabulary({"a": 0, "d": 1, "c": 2}), 3)  # type: ignore[arg-type]
    assert caught.value.param == "speculative_config.model"
    with pytest.raises(InvalidParameterError, match="LM head has 2 rows") as caught:
        check_same_vocabulary(target, _Vocabulary(target.vocab), 2)  # type: ignore[arg-type]
    assert caught.value.param == "speculative_config.model"
