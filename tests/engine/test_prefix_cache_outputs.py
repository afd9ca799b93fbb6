"""Prefix caching and priority scheduling never change what a request generates.

Each scenario runs twice on a tiny random Llama (the cache-hit scenarios on a
tiny GPT-2 too, whose positions are learned), with ``enable_prefix_caching``
on and off; the tokens must agree, and the engine's statistics must show that
the cache was actually hit. As in test_batching_invariance.py, a divergence
is tolerated only at a genuine near-tie of two tokens, and only from there on.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.attention import torch_paged
from kvserve.attention.cascade import cascade_decode
from kvserve.outputs import CompletionOutput
from model_fixtures import save_tiny_model, train_tiny_tokenizer

BLOCK_SIZE = 4
NEAR_TIE = 1e-3
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tiny_tokenizer()
    return {
        kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer)
        for kind in ("llama", "gpt2")
    }


@pytest.fixture(scope="module")
def model_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


def make_llm(model_dir: Path, caching: bool, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(num_blocks=256, enable_prefix_caching=caching)
    args.update(engine_args)
    return LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, **args)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(count)]


def both_params() -> list[SamplingParams]:
    common: dict[str, Any] = dict(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return [
        SamplingParams(temperature=0, **common),
        SamplingParams(temperature=0.9, top_p=0.95, seed=77, **common),
    ]


def assert_close(expected: CompletionOutput, actual: CompletionOutput, label: str) -> None:
    assert len(expected.token_ids) == len(actual.token_ids) == MAX_TOKENS
    assert expected.logprobs is not None and actual.logprobs is not None
    for position, (want, got) in enumerate(zip(expected.token_ids, actual.token_ids, strict=True)):
        if want != got:
            want_logprobs = expected.logprobs[position]
            assert got in want_logprobs, f"{label}: token {position} differs"
            gap = abs(want_logprobs[want].logprob - want_logprobs[got].logprob)
            assert gap < NEAR_TIE, f"{label}: token {position} differs, logprob gap {gap:.2e}"
            return


def generate_after_warmup(
    llm: LLM, warmup: list[int], prompt: list[int], params: SamplingParams
) -> tuple[CompletionOutput, int]:
    """From a cold cache, run ``warmup``, then ``prompt``; return its completion and hit tokens."""
    assert llm.llm_engine.reset_prefix_cache()
    llm.generate({"prompt_token_ids": warmup}, params, use_tqdm=False)
    hits_before = llm.llm_engine.stats.prefix_cache_hits
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    return output, llm.llm_engine.stats.prefix_cache_hits - hits_before


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_cache_hits_give_the_same_tokens_as_computing_everything(
    model_dirs: dict[str, Path], kind: str
) -> None:
    model_dir = model_dirs[kind]
    rng = random.Random(5)
    shared = random_tokens(rng, 29)  # 7 full blocks and one token
    scenarios = {
        # warm-up prompt, prompt, expected hit tokens
        "hit ends mid-prompt": (shared, [*shared[:22], *random_tokens(rng, 9)], 20),
        "hit covers all but the last token": (shared, shared, 28),
        "block-aligned prompt recomputes its last block": (shared, shared[:28], 24),
    }
    cached, uncached = make_llm(model_dir, caching=True), make_llm(model_dir, caching=False)
    for label, (warmup, prompt, expected_hits) in scenarios.items():
        for params in both_params():
            want, no_hits = generate_after_warmup(uncached, warmup, prompt, params)
            got, hits = generate_after_warmup(cached, warmup, prompt, params)
            assert no_hits == 0
            assert hits == expected_hits, label
            assert_close(want, got, f"{label}, temperature {params.temperature}")


def test_a_follow_up_turn_hits_the_previous_turns_generated_tokens(model_dir: Path) -> None:
    rng = random.Random(6)
    prompt = random_tokens(rng, 10)
    params = both_params()[0]
    results = []
    for caching in (False, True):
        llm = make_llm(model_dir, caching=caching)
        first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        follow_up = [*prompt, *first.outputs[0].token_ids, *random_tokens(random.Random(7), 5)]
        output = llm.generate({"prompt_token_ids": follow_up}, params, use_tqdm=False)[0]
        results.append((output.outputs[0], llm.llm_engine.stats.prefix_cache_hits))
    (want, no_hits), (got, hits) = results
    assert no_hits == 0
    # 10 prompt + 11 computed output tokens (the last sampled one never is): 5 full blocks.
    assert hits == 20
    assert_close(want, got, "follow-up turn")


def test_n_sequences_share_their_prompt_blocks(model_dir: Path) -> None:
    prompt = {"prompt_token_ids": random_tokens(random.Random(8), 18)}
    params = SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2
    )
    outputs = {}
    for caching in (False, True):
        llm = make_llm(model_dir, caching=caching)
        outputs[caching] = llm.generate(prompt, params, use_tqdm=False)[0].outputs
        stats = llm.llm_engine.stats
    # The second and third sequences take the first's 4 full prompt blocks from the cache.
    assert stats.prefix_cache_hits == 2 * 16
    for want, got in zip(outputs[False], outputs[True], strict=True):
        assert_close(want, got, f"sequence {want.index}")


def test_cache_salts_isolate_tenants(model_dir: Path) -> None:
    llm = make_llm(model_dir, caching=True)
    prompt = {"prompt_token_ids": random_tokens(random.Random(9), 17)}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    hits = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        before = llm.llm_engine.stats.prefix_cache_hits
        llm.generate(prompt, params, use_tqdm=False, cache_salt=salt)
        hits.append(llm.llm_engine.stats.prefix_cache_hits - before)
    assert hits == [0, 0, 0, 16]


def test_chat_passes_cache_salt_and_priority_through(model_dir: Path) -> None:
    llm = make_llm(model_dir, caching=True)
    tokenizer = llm.get_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    conversation = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    num_prompt_tokens = len(llm.apply_chat_template(conversation)["prompt_token_ids"])
    hits = []
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        before = llm.llm_engine.stats.prefix_cache_hits
        llm.chat(conversation, params, use_tqdm=False, cache_salt=salt)
        hits.append(llm.llm_engine.stats.prefix_cache_hits - before)
    # Only the repeated salt hits, on every full block but the one holding the last token.
    assert hits == [0, 0, (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE]
    with pytest.raises(ValueError, match="priority"):
        llm.chat(conversation, params, use_tqdm=False, priority=1)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_late_high_priority_request_jumps_the_queue_and_preempts_low_priority_ones(
    model_dir: Path,
) -> None:
    rng = random.Random(10)
    prompts = [random_tokens(rng, 12) for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = make_llm(model_dir, caching=True)
    expected = [
        alone.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    ]
    # 12 usable blocks: after 4 steps the three low-priority requests hold 4 blocks each.
    llm = make_llm(model_dir, caching=True, num_blocks=13, policy="priority")
    engine = llm.llm_engine
    names = ["low-0", "low-1", "low-2", "low-3", "high"]
    for index in range(3):
        engine.add_request(names[index], {"prompt_token_ids": prompts[index]}, params, priority=5)
    for _ in range(4):
        engine.step()
    assert engine.stats.num_blocks_free == 0 and engine.stats.num_preemptions == 0
    engine.add_request("low-3", {"prompt_token_ids": prompts[3]}, params, priority=5)
    engine.add_request("high", {"prompt_token_ids": prompts[4]}, params, priority=0)
    first = {output.request_id for output in engine.step()}
    # "high" is admitted at once, ahead of the earlier "low-3", by preempting a low one.
    assert "high" in first and "low-3" not in first
    assert engine.stats.num_preemptions == 1
    finish_order, tokens = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finish_order.append(output.request_id)
                tokens[output.request_id] = output.outputs[0].token_ids
    assert all(finish_order.index("high") < finish_order.index(n) for n in names[1:4])
    for index, name in enumerate(names):
        assert tokens[name] == expected[index], name


def test_priority_needs_the_priority_policy(model_dir: Path) -> None:
    llm = make_llm(model_dir, caching=True)
    with pytest.raises(ValueError, match="priority"):
        llm.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False, priority=1)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False, cache_salt=["a", "b"])
    assert not llm.llm_engine.has_unfinished_requests()


def test_stats_follow_a_generation(model_dir: Path) -> None:
    llm = make_llm(model_dir, caching=True, max_num_batched_tokens=8, max_num_seqs=8)
    engine = llm.llm_engine
    assert engine.stats.num_blocks_free == engine.stats.num_blocks_total == 255
    engine.add_request(
        "r",
        {"prompt_token_ids": random_tokens(random.Random(11), 10)},
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    )
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats
        seen.append((stats.num_prefill_tokens, stats.num_decode_tokens))
    # A 10-token prompt in chunks of 8 and 2, then two decodes; the last token is never computed.
    assert seen == [(8, 0), (2, 0), (0, 1), (0, 1)]
    assert stats.num_steps == 4 and stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_used == 0
    assert stats.num_blocks_cached == 3  # 12 computed tokens fill 3 blocks of 4


def test_decodes_sharing_a_long_prefix_use_cascade_attention_with_the_same_outputs(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def counting_cascade_decode(*args: Any) -> Any:
        calls.append(1)
        return cascade_decode(*args)

    monkeypatch.setattr(torch_paged, "cascade_decode", counting_cascade_decode)
    rng = random.Random(12)
    shared = random_tokens(rng, 264)  # 66 blocks: over MIN_CASCADE_PREFIX_LEN
    prompts = [{"prompt_token_ids": [*shared, *random_tokens(rng, 6)]} for _ in range(4)]
    outputs = {}
    for caching in (False, True):
        # Cascade decode is the PyTorch backend's; the native kernel reads pages in place.
        llm = make_llm(model_dir, caching=caching, attention_backend="torch_paged")
        outputs[caching] = llm.generate(prompts, both_params() * 2, use_tqdm=False)
        assert bool(calls) == caching  # without sharing there is no common prefix
    assert llm.llm_engine.stats.prefix_cache_hits == 3 * 264
    for index, (want, got) in enumerate(zip(outputs[False], outputs[True], strict=True)):
        assert_close(want.outputs[0], got.outputs[0], f"request {index}")
