"""Speculative decoding (n-gram proposals) never changes what a model generates greedily.

Every scenario runs on an engine without speculation (the reference) and one
with ``speculative_config``; greedy tokens must agree. The two engines
compute a token's logits on different paths (a decode row against a
verification row, one of several decode rows of the request over the cached
context, attended in another order and batch shape), so, as in
test_batching_invariance.py, a divergence is tolerated only at a genuine
near-tie of two tokens, and only from there on (``greedy_checks.py``). The
engine's counters must show that proposals were made, accepted and rejected,
so that the comparison means something, and the KV pool must be whole again
at the end.

Most scenarios run on the tiny random Llama (``tiny_model_dir``): verification
does not depend on what the weights are, and a random model's greedy output
often loops, so n-gram proposals from its own output are accepted and others
are not. One runs on SmolLM2, whose output repeats its prompt the way real
text does. Its weights are dequantized (``quantization="none"``, float32):
the GGUF's quantized product rounds activations differently with the number
of rows in a step, so that a prompt's prefill and its decode already differ
by ~5e-2 in logprob without any speculation; that would hide real errors here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from greedy_checks import assert_pool_whole, assert_same_tokens, completions, greedy, spec_counters
from kvserve import LLM, SamplingParams
from kvserve.core.block_hash import extend_block_hashes
from kvserve.outputs import CompletionOutput

NEAR_TIE = 1e-4
# Every decoding request proposes (not adaptive): what the tests count never depends
# on how long steps took.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}

# Output that repeats its context (proposals accepted) and output that does not.
CODE = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "# The two functions above, with the argument a renamed to x:\ndef add(x, b):\n"
)
QUOTE = (
    "The report said: 'Revenue grew by twelve percent in the third quarter, driven by "
    "strong sales in Europe and Asia.' Quote the report's sentence word for word: 'Revenue"
)
FREE = "Write a short poem about a lighthouse keeper who"

# Token prompts for the tiny Llama. On the first three its greedy output falls into loops,
# which n-gram proposals guess; on the last it seldom repeats itself: proposals are made,
# and hardly any is accepted.
LOOPING = {"prompt_token_ids": [51, 190, 32, 262, 112, 22, 47, 225] + [80, 205, 27, 40] * 5}
CYCLING = {"prompt_token_ids": [80, 121] + [186, 197, 121, 80, 45] * 7}
STUTTERING = {"prompt_token_ids": [193, 52, 283] + [289, 95, 55, 295] * 7}
RAMBLING = {"prompt_token_ids": [108, 257, 275, 221, 163, 241, 235, 188, 156] + [291, 33] * 3}


def make_llm(model: Path | str, speculative: bool, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(dtype="float32", block_size=4, num_blocks=256)
    args.update(engine_args)
    if speculative:
        args["speculative_config"] = SPEC
    return LLM(str(model), **args)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, False)


@pytest.fixture(scope="module")
def speculative(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, True)


def check_greedy_output_is_unchanged(
    reference: LLM, speculative: LLM, prompts: list[Any], accepted_above: int, **params: Any
) -> None:
    """``prompts`` in one batch: the same tokens, and proposals both accepted (more than
    ``accepted_above``) and rejected, in fewer steps than tokens."""
    want = completions(reference, prompts, greedy(**params))
    proposed_before, accepted_before = spec_counters(speculative)
    steps_before = speculative.llm_engine.stats.num_steps
    got = completions(speculative, prompts, greedy(**params))
    for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
        assert_same_tokens(expected, actual, f"prompt {index}", NEAR_TIE)
    proposed, accepted = spec_counters(speculative)
    assert accepted - accepted_before > accepted_above
    assert proposed - proposed_before > accepted - accepted_before  # and some guesses fail
    # Fewer forward passes than generated tokens: accepted proposals saved steps.
    num_tokens = max(len(c.token_ids) for c in got)
    assert speculative.llm_engine.stats.num_steps - steps_before < num_tokens
    assert_pool_whole(speculative)


def test_greedy_output_is_unchanged_and_proposals_are_accepted(
    reference: LLM, speculative: LLM
) -> None:
    # Not RAMBLING: a request that accepts nothing would take a step per token.
    prompts = [LOOPING, CYCLING, STUTTERING]
    check_greedy_output_is_unchanged(
        reference, speculative, prompts, accepted_above=20, ignore_eos=True
    )


@pytest.mark.slow
def test_smollm2_greedy_output_is_unchanged_and_proposals_are_accepted() -> None:
    """End to end on the real model: its output quotes the prompt (QUOTE) and renames a
    function (CODE), so the proposals taken from the prompt are mostly right, and its free
    verse (FREE) is not guessed; a tiny random model only ever repeats itself."""
    engine: dict[str, Any] = dict(quantization="none", block_size=16, num_blocks=128)
    reference = make_llm("smollm2-135m-instruct", False, **engine)
    speculative = make_llm("smollm2-135m-instruct", True, **engine)
    check_greedy_output_is_unchanged(reference, speculative, [CODE, QUOTE, FREE], accepted_above=20)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_shipped_models_greedy_output_is_exactly_unchanged(model: str) -> None:
    """The defaults users run (the file's own quantized weights, a bf16 KV cache): one
    request at a time, greedy output with proposals is token for token the output
    without, with no near-tie allowance. A verification row takes the same integer
    product as a decode row (each row of activations is multiplied on its own), and
    the decode attention splits every row's keys at the same places in any step and
    reads a request's verification rows together in the order each would alone (Gemma
    3's sliding-window layers attend each row alone)."""
    engine: dict[str, Any] = dict(dtype="auto", block_size=16, num_blocks=128)
    reference = make_llm(model, False, **engine)
    speculative = make_llm(model, True, **engine)
    _, accepted_before = spec_counters(speculative)
    for label, prompt in (("code", CODE), ("quote", QUOTE), ("free", FREE)):
        (want,) = completions(reference, [prompt], greedy(96))
        (got,) = completions(speculative, [prompt], greedy(96))
        assert got.token_ids == want.token_ids, label
    assert spec_counters(speculative)[1] - accepted_before > 20  # proposals were checked
    assert_pool_whole(speculative)


def test_each_request_alone_matches(reference: LLM, speculative: LLM) -> None:
    _, accepted_before = spec_counters(speculative)
    for label, prompt in (("looping", LOOPING), ("rambling", RAMBLING)):
        (want,) = completions(reference, [prompt], greedy(32, ignore_eos=True))
        proposed_before, _ = spec_counters(speculative)
        (got,) = completions(speculative, [prompt], greedy(32, ignore_eos=True))
        assert_same_tokens(want, got, label, NEAR_TIE)
        assert spec_counters(speculative)[0] > proposed_before, label
    assert spec_counters(speculative)[1] > accepted_before
    assert_pool_whole(speculative)


def test_stops_apply_per_accepted_token(reference: LLM, speculative: LLM) -> None:
    """max_tokens, stop strings and stop ids end the output where they would without proposals.

    The stops are ones the reference's own output first meets after its first ten tokens,
    where the loop it runs in is being guessed.
    """
    (free_run,) = completions(reference, [CYCLING], greedy(40, ignore_eos=True))
    ids, text = free_run.token_ids, free_run.text
    stop_id = next(t for i, t in enumerate(ids) if i >= 10 and t not in ids[:i])
    stop_text = next(
        text[i : i + 2]
        for i in range(len(text) // 4, len(text) - 1)
        if text[i : i + 2].isprintable() and text[i : i + 2] not in text[: i + 1]
    )
    cases = [
        greedy(7, ignore_eos=True),  # reached in the middle of a step's accepted tokens
        greedy(40, ignore_eos=True, stop=[stop_text]),
        greedy(40, ignore_eos=True, stop=[stop_text], include_stop_str_in_output=True),
        greedy(40, ignore_eos=True, stop_token_ids=[stop_id]),
    ]
    _, accepted_before = spec_counters(speculative)
    for params in cases:
        (want,) = completions(reference, [CYCLING], params)
        (got,) = completions(speculative, [CYCLING], params)
        label = repr(params.stop or params.stop_token_ids or params.max_tokens)
        assert_same_tokens(want, got, label, NEAR_TIE)
        assert want.finish_reason == ("length" if params is cases[0] else "stop"), label
        assert got.stop_reason == want.stop_reason, label
    assert spec_counters(speculative)[1] > accepted_before
    assert_pool_whole(speculative)


def test_logprobs_match_those_without_speculation(reference: LLM, speculative: LLM) -> None:
    (want,) = completions(reference, [LOOPING], greedy(24, ignore_eos=True))
    _, accepted_before = spec_counters(speculative)
    (got,) = completions(speculative, [LOOPING], greedy(24, ignore_eos=True))
    assert spec_counters(speculative)[1] > accepted_before  # some logprobs are of verified rows
    assert want.token_ids == got.token_ids and want.logprobs and got.logprobs
    assert len(got.logprobs) == len(got.token_ids)
    for expected, actual in zip(want.logprobs, got.logprobs, strict=True):
        assert expected.keys() == actual.keys()
        for token_id, entry in expected.items():
            assert actual[token_id].logprob == pytest.approx(entry.logprob, abs=2e-3)
            assert actual[token_id].rank == entry.rank


def test_steps_of_decodes_and_verifications_take_the_one_call_decoder(
    speculative: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verification is decode rows (``input_batch.py``), so a step without a prefill
    chunk runs every layer in the native decoder's one call, proposals or not."""
    runner = speculative.llm_engine.runner
    decoder = runner.native_decoder
    assert decoder is not None, "the tiny Llama's float32 layers are ones the kernel walks"
    steps: list[tuple[bool, bool]] = []  # (has proposals, has a prefill chunk) per step
    one_calls: list[bool] = []  # per step, whether the one-call decoder ran it
    forward, run = runner.forward, decoder.run

    def watched_forward(inputs: Any) -> Any:
        steps.append((inputs.spec_token_ids is not None, bool(inputs.attn_layouts[0].prefills)))
        one_calls.append(False)
        return forward(inputs)

    def watched_run(*args: Any) -> Any:
        one_calls[-1] = True
        return run(*args)

    monkeypatch.setattr(runner, "forward", watched_forward)
    monkeypatch.setattr(decoder, "run", watched_run)
    # A prompt cached by an earlier test would leave one token to compute, a decode row.
    assert speculative.llm_engine.reset_prefix_cache()
    completions(speculative, [CYCLING], greedy(32, ignore_eos=True))
    verifying = [
        one for (spec, prefill), one in zip(steps, one_calls, strict=True) if spec and not prefill
    ]
    assert len(verifying) > 3
    assert all(verifying)
    # The prompt's prefill is a chunk, which the one call does not take.
    assert steps[0] == (False, True) and not one_calls[0]


def test_chunked_prefill_preemption_and_prefix_hits(tiny_model_dir: Path) -> None:
    """A small step budget chunks the prompts, a small pool preempts, a repeated prompt hits."""
    args: dict[str, Any] = dict(num_blocks=25, max_num_batched_tokens=32, max_num_seqs=3)
    looping = LOOPING["prompt_token_ids"]
    prompts = [LOOPING, CYCLING, {"prompt_token_ids": [*looping, 80, 205]}]
    params = greedy(24, ignore_eos=True)
    reference = make_llm(tiny_model_dir, False, **args)
    want = completions(reference, prompts, params)
    speculative = make_llm(tiny_model_dir, True, **args)
    got = completions(speculative, prompts, params)
    for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
        assert_same_tokens(expected, actual, f"prompt {index}", NEAR_TIE)
    engine = speculative.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.stats.prefix_cache_hits > 0
    assert spec_counters(speculative)[1] > 0
    assert_pool_whole(speculative)
    assert_cached_blocks_hold_kept_tokens(speculative, prompts, got)


def assert_cached_blocks_hold_kept_tokens(
    llm: LLM, prompts: list[dict[str, list[int]]], outputs: list[CompletionOutput]
) -> None:
    """Every block in the prefix cache is a block of some prompt + output that was kept."""
    kv = llm.llm_engine.kv_cache_manager
    kept: set[object] = set()
    for prompt, output in zip(prompts, outputs, strict=True):
        hashes: list[Any] = []
        tokens = prompt["prompt_token_ids"] + list(output.token_ids)
        extend_block_hashes(hashes, tokens, kv.block_size, None)
        kept.update(hashes)
    cached = kv.block_pool.cached_block_hashes()
    assert cached, "the scenario should leave blocks in the prefix cache"
    assert cached <= kept


def test_seeded_sampling_is_reproducible_with_proposals(tiny_model_dir: Path) -> None:
    params = SamplingParams(
        temperature=0.8, top_p=0.95, top_k=50, max_tokens=24, seed=1234, repetition_penalty=1.05
    )
    runs = []
    for _ in range(2):
        llm = make_llm(tiny_model_dir, True)
        runs.append(completions(llm, [CODE], params))
        assert spec_counters(llm)[0] > 0
        assert_pool_whole(llm)
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]


def test_no_work_without_speculative_config(reference: LLM) -> None:
    completions(reference, [LOOPING], greedy(16))
    assert reference.llm_engine.scheduler.proposer is None
    assert spec_counters(reference) == (0, 0)


@pytest.mark.slow
def test_smollm2_drafting_for_itself_is_fully_accepted() -> None:
    """The draft_model method with the target as its own draft: every proposal is the
    target's own greedy token, so all are accepted and the output is the reference's."""
    config = {
        "method": "draft_model",
        "model": "smollm2-135m-instruct",
        "num_speculative_tokens": 4,
        "adaptive": False,
    }
    engine: dict[str, Any] = dict(quantization="none", block_size=16, num_blocks=128)
    reference = make_llm("smollm2-135m-instruct", False, **engine)
    speculative = make_llm("smollm2-135m-instruct", False, speculative_config=config, **engine)
    prompts = [FREE]
    want = completions(reference, prompts, greedy(16, ignore_eos=True))
    got = completions(speculative, prompts, greedy(16, ignore_eos=True))
    for label, expected, actual in zip(prompts, want, got, strict=True):
        assert_same_tokens(expected, actual, label[:20], NEAR_TIE)
    scheduler = speculative.llm_engine.scheduler
    assert scheduler.num_spec_proposed_total > 0
    assert scheduler.num_spec_accepted_total == scheduler.num_spec_proposed_total
    assert_pool_whole(speculative)
    draft = speculative.llm_engine.draft_proposer
    assert draft is not None and not draft.engine.has_unfinished_requests()
    assert (
        draft.engine.kv_cache_manager.num_free_blocks
        == draft.engine.kv_cache_manager.num_usable_blocks
    )
