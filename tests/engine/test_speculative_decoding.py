"""Speculative decoding (n-gram proposals) never changes what SmolLM2 generates greedily.

Every scenario runs on an engine without speculation (the reference) and one
with ``speculative_config``; greedy tokens must agree. The two engines
compute a token's logits on different paths (a decode row against a
verification row, one of several decode rows of the request over the cached
context, attended in another order and batch shape), so, as in
test_batching_invariance.py, a divergence is tolerated only at a genuine
near-tie of two tokens, and only from there on. The engine's counters must
show that proposals were made and accepted, so that the comparison means
something, and the KV pool must be whole again at the end.

The weights are dequantized (``quantization="none"``, float32): the GGUF's
quantized product rounds activations differently with the number of rows in
a step, so that a prompt's prefill and its decode already differ by ~5e-2 in
logprob without any speculation; that would hide real errors here.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.block_hash import extend_block_hashes
from kvserve.outputs import CompletionOutput, RequestOutput

MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16
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


def make_llm(speculative: bool, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(
        dtype="float32", quantization="none", block_size=BLOCK_SIZE, num_blocks=128
    )
    args.update(engine_args)
    if speculative:
        args["speculative_config"] = SPEC
    return LLM(MODEL, **args)


@pytest.fixture(scope="module")
def reference() -> LLM:
    return make_llm(False)


@pytest.fixture(scope="module")
def speculative() -> LLM:
    return make_llm(True)


def greedy(max_tokens: int = 40, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, **extra)


def completions(llm: LLM, prompts: list[str], params: SamplingParams) -> list[CompletionOutput]:
    outputs: list[RequestOutput] = llm.generate(prompts, params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def assert_same_tokens(expected: CompletionOutput, actual: CompletionOutput, label: str) -> None:
    assert expected.logprobs is not None and actual.logprobs is not None
    for position, (want, got) in enumerate(zip(expected.token_ids, actual.token_ids, strict=False)):
        if want == got:
            continue
        want_logprobs, got_logprobs = expected.logprobs[position], actual.logprobs[position]
        assert got in want_logprobs and want in got_logprobs, f"{label}: token {position} differs"
        gap = abs(want_logprobs[want].logprob - want_logprobs[got].logprob)
        assert gap < NEAR_TIE, f"{label}: token {position} differs with logprob gap {gap:.2e}"
        return
    assert expected.token_ids == actual.token_ids, f"{label}: lengths differ"
    assert expected.text == actual.text, label
    assert expected.finish_reason == actual.finish_reason, label


def assert_pool_whole(llm: LLM) -> None:
    """No request holds a block, and every cached block holds tokens some sequence kept."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks


def counters(llm: LLM) -> tuple[int, int]:
    stats = llm.llm_engine.stats
    return stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens


def test_greedy_output_is_unchanged_and_proposals_are_accepted(
    reference: LLM, speculative: LLM
) -> None:
    prompts = [CODE, QUOTE, FREE]
    want = completions(reference, prompts, greedy())
    proposed_before, accepted_before = counters(speculative)
    steps_before = speculative.llm_engine.stats.num_steps
    got = completions(speculative, prompts, greedy())
    for label, expected, actual in zip(prompts, want, got, strict=True):
        assert_same_tokens(expected, actual, label[:20])
    proposed, accepted = counters(speculative)
    assert accepted - accepted_before > 20  # the repeating prompts are mostly guessed right
    assert proposed - proposed_before > accepted - accepted_before  # and some guesses fail
    # Fewer forward passes than generated tokens: accepted proposals saved steps.
    num_tokens = max(len(c.token_ids) for c in got)
    assert speculative.llm_engine.stats.num_steps - steps_before < num_tokens
    assert_pool_whole(speculative)


def test_each_request_alone_matches(reference: LLM, speculative: LLM) -> None:
    for prompt in (CODE, FREE):
        (want,) = completions(reference, [prompt], greedy(32))
        (got,) = completions(speculative, [prompt], greedy(32))
        assert_same_tokens(want, got, prompt[:20])
    assert_pool_whole(speculative)


def test_stops_apply_per_accepted_token(reference: LLM, speculative: LLM) -> None:
    """max_tokens, stop strings and stop ids end the output where they would without proposals."""
    stop_id = reference.llm_engine.tokenizer.encode("sub")[0]
    cases = [
        greedy(7),  # reached in the middle of a step's accepted tokens
        greedy(40, stop=["b):\ndef"]),
        greedy(40, stop=["(x"], include_stop_str_in_output=True),
        greedy(40, stop_token_ids=[stop_id]),
    ]
    for params in cases:
        (want,) = completions(reference, [CODE], params)
        (got,) = completions(speculative, [CODE], params)
        assert_same_tokens(want, got, repr(params.stop or params.max_tokens))
        assert got.stop_reason == want.stop_reason
    assert_pool_whole(speculative)


def test_logprobs_match_those_without_speculation(reference: LLM, speculative: LLM) -> None:
    (want,) = completions(reference, [CODE], greedy(24))
    (got,) = completions(speculative, [CODE], greedy(24))
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
    assert decoder is not None, "SmolLM2's float32 layers are ones the kernel walks"
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
    completions(speculative, [CODE], greedy(32))
    verifying = [
        one for (spec, prefill), one in zip(steps, one_calls, strict=True) if spec and not prefill
    ]
    assert len(verifying) > 3
    assert all(verifying)
    # The prompt's prefill is a chunk, which the one call does not take.
    assert steps[0] == (False, True) and not one_calls[0]


def test_chunked_prefill_preemption_and_prefix_hits() -> None:
    """A small step budget chunks the prompts, a small pool preempts, a repeated prompt hits."""
    args: dict[str, Any] = dict(num_blocks=10, max_num_batched_tokens=32, max_num_seqs=3)
    prompts = [CODE, QUOTE, CODE + "    return x"]
    params = greedy(24, ignore_eos=True)
    reference = make_llm(False, **args)
    want = completions(reference, prompts, params)
    speculative = make_llm(True, **args)
    got = completions(speculative, prompts, params)
    for label, expected, actual in zip(prompts, want, got, strict=True):
        assert_same_tokens(expected, actual, label[:20])
    engine = speculative.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.stats.prefix_cache_hits > 0
    assert counters(speculative)[1] > 0
    assert_pool_whole(speculative)
    assert_cached_blocks_hold_kept_tokens(speculative, prompts, got)


def assert_cached_blocks_hold_kept_tokens(
    llm: LLM, prompts: list[str], outputs: list[CompletionOutput]
) -> None:
    """Every block in the prefix cache is a block of some prompt + output that was kept."""
    kv = llm.llm_engine.kv_cache_manager
    tokenizer = llm.llm_engine.tokenizer
    kept: set[object] = set()
    for prompt, output in zip(prompts, outputs, strict=True):
        hashes: list[Any] = []
        tokens = tokenizer.encode(prompt) + list(output.token_ids)
        extend_block_hashes(hashes, tokens, kv.block_size, None)
        kept.update(hashes)
    cached = kv.block_pool.cached_block_hashes()
    assert cached, "the scenario should leave blocks in the prefix cache"
    assert cached <= kept


def test_seeded_sampling_is_reproducible_with_proposals() -> None:
    params = SamplingParams(
        temperature=0.8, top_p=0.95, top_k=50, max_tokens=24, seed=1234, repetition_penalty=1.05
    )
    runs = []
    for _ in range(2):
        llm = make_llm(True)
        runs.append(completions(llm, [CODE], params))
        assert counters(llm)[0] > 0
        assert_pool_whole(llm)
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]


def test_no_work_without_speculative_config(reference: LLM) -> None:
    completions(reference, [CODE], greedy(16))
    assert reference.llm_engine.scheduler.proposer is None
    assert counters(reference) == (0, 0)


@pytest.mark.slow  # two more SmolLM2 loads (target and draft) than the module's others
def test_smollm2_drafting_for_itself_is_fully_accepted(reference: LLM) -> None:
    """The draft_model method with the target as its own draft: every proposal is the
    target's own greedy token, so all are accepted and the output is the reference's."""
    config = {
        "method": "draft_model",
        "model": MODEL,
        "num_speculative_tokens": 4,
        "adaptive": False,
    }
    speculative = make_llm(False, speculative_config=config)
    prompts = [FREE]
    want = completions(reference, prompts, greedy(16, ignore_eos=True))
    got = completions(speculative, prompts, greedy(16, ignore_eos=True))
    for label, expected, actual in zip(prompts, want, got, strict=True):
        assert_same_tokens(expected, actual, label[:20])
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
