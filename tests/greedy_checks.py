"""Checks for tests that run the same requests on two engines and compare what they generate.

Two engines may compute a token's logits on different paths (alone or batched,
chunked, a decode row or a verification row), which reorders floating-point
sums. That may legitimately flip a genuine near-tie of two tokens; only then
may two greedy runs diverge, and only from that token on (the check vLLM's
``check_logprobs_close`` makes). Anything else is an error.
"""

from __future__ import annotations

from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.outputs import CompletionOutput, RequestOutput


def greedy(max_tokens: int = 40, **extra: Any) -> SamplingParams:
    """Greedy decoding with the top two logprobs, which :func:`assert_same_tokens` reads."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, **extra)


def completions(llm: LLM, prompts: list[Any], params: SamplingParams) -> list[CompletionOutput]:
    """The first completion of each prompt (text or ``{"prompt_token_ids": ...}``)."""
    outputs: list[RequestOutput] = llm.generate(prompts, params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def assert_same_tokens(
    expected: CompletionOutput, actual: CompletionOutput, label: str, near_tie: float
) -> None:
    """The same tokens, text and finish reason; or the same tokens up to a position where
    the two differ at a near-tie (logprob gap under ``near_tie``), which ends the check.

    Both completions must have been asked for ``logprobs >= 2``, so that each holds the
    other's token at the position where they part.
    """
    assert expected.logprobs is not None and actual.logprobs is not None
    for position, (want, got) in enumerate(zip(expected.token_ids, actual.token_ids, strict=False)):
        if want == got:
            continue
        want_logprobs, got_logprobs = expected.logprobs[position], actual.logprobs[position]
        assert got in want_logprobs and want in got_logprobs, f"{label}: token {position} differs"
        gap = abs(want_logprobs[want].logprob - want_logprobs[got].logprob)
        assert gap < near_tie, f"{label}: token {position} differs with logprob gap {gap:.2e}"
        return
    assert expected.token_ids == actual.token_ids, f"{label}: lengths differ"
    assert expected.text == actual.text, label
    assert expected.finish_reason == actual.finish_reason, label


def assert_pool_whole(llm: LLM) -> None:
    """No request is left, and none holds a block of the KV pool."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks


def spec_counters(llm: LLM) -> tuple[int, int]:
    """How many speculative tokens ``llm`` has proposed and accepted so far."""
    stats = llm.llm_engine.stats
    return stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens
