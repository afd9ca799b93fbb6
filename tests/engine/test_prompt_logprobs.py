"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers.

transformers scores each prompt in one teacher-forced pass over the same
checkpoint, in float32: an independent reference for every prompt position.
kvserve computes the same values in chunks of a few tokens, beside requests
that ask for nothing or for sampled logprobs, and with the prefix cache on.

The model is the tiny random Llama (``tiny_model_dir``): what is checked is how
the engine gathers, ranks and returns each position's values through chunks,
the prefix cache and preemption, none of which depends on the weights; the
real model's logits are checked against transformers in tests/models.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from kvserve import LLM, SamplingParams
from kvserve.core.request import Request
from kvserve.engine.request_group import RequestGroup
from kvserve.errors import InvalidParameterError
from kvserve.outputs import Logprob, RequestMetrics
from kvserve.worker.prompt_logprobs import PromptLogprobsChunk
from model_fixtures import teacher_forced_logprobs

PROMPTS = [
    "The capital of France is Paris, and the capital of Spain is Madrid. The capital of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
# float32 on both sides: only the order of additions differs.
ATOL = 1e-4
NUM_TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    # Chunks of at most 8 tokens: every prompt spans several steps, and a chunk's
    # rows are gathered apart from the next one's.
    return LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_blocks=256,
        block_size=16,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        enable_prefix_caching=True,
    )


def assert_matches_reference(
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
    prompt: list[int],
    reference: PreTrainedModel,
    num_top: int,
) -> None:
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    # Row i: the log-distribution of prompt token i + 1 given tokens 0..i.
    rows = teacher_forced_logprobs(reference, prompt[:1], prompt[1:])
    for position in range(1, len(prompt)):
        entry = prompt_logprobs[position]
        assert entry is not None, position
        token, row = prompt[position], rows[position - 1]
        assert abs(entry[token].logprob - row[token].item()) <= ATOL, position
        # Its rank counts the tokens more likely than it (up to float32 near-ties).
        lowest = int((row > row[token] + ATOL).sum()) + 1
        highest = int((row > row[token] - ATOL).sum()) + 1
        assert lowest <= entry[token].rank <= highest, position
        # The top k, with the prompt token among them only if it is one of them.
        top = [(e.logprob, tid) for tid, e in entry.items() if tid != token or e.rank <= num_top]
        top.sort(reverse=True)
        assert len(top) == num_top, position
        top_values, top_ids = row.topk(num_top + 1)
        for k, (value, tid) in enumerate(top):
            assert abs(value - top_values[k].item()) <= ATOL, (position, k)
            gap_above = top_values[k - 1] - top_values[k] if k else 1.0
            if min(gap_above, top_values[k] - top_values[k + 1]) > ATOL:  # not a near-tie
                assert tid == top_ids[k].item(), (position, k)
        assert entry[token].decoded_token is not None


def test_prompt_logprobs_equal_transformers_at_every_position_through_chunks(
    llm: LLM, reference: PreTrainedModel
) -> None:
    tokenizer = llm.get_tokenizer()
    asking = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=NUM_TOP)
    plain = SamplingParams(temperature=0, max_tokens=3)
    sampled_logprobs = SamplingParams(temperature=0, max_tokens=3, logprobs=2)
    # The prompts that ask share the batch with ones that do not.
    prompts = [*PROMPTS, "Hello there, how are you", "The three primary colors are"]
    params = [asking] * len(PROMPTS) + [plain, sampled_logprobs]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=False):
        prompt_ids = tokenizer.encode(prompt)
        assert len(prompt_ids) > 16  # several chunks of 8
        assert output.prompt_token_ids == prompt_ids
        assert_matches_reference(output.prompt_logprobs, prompt_ids, reference, NUM_TOP)
    for output in outputs[len(PROMPTS) :]:
        assert output.prompt_logprobs is None


def test_prompt_logprobs_zero_returns_only_the_prompt_token(
    llm: LLM, reference: PreTrainedModel
) -> None:
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (output,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    assert output.prompt_logprobs is not None
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        assert entry is not None and list(entry) == [prompt_ids[position]]
    assert_matches_reference(output.prompt_logprobs, prompt_ids, reference, 0)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(
    llm: LLM, reference: PreTrainedModel
) -> None:
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[2])
    engine = llm.llm_engine
    # First without prompt logprobs: its full blocks enter the prefix cache. Had the
    # second run taken them, its prompt logprobs would start late and the request fail.
    llm.generate(
        [{"prompt_token_ids": prompt_ids}],
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
    )
    probe = Request("probe", prompt_ids, SamplingParams())
    assert engine.kv_cache_manager.get_computed_blocks(probe).num_tokens > 0
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    (output,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    assert_matches_reference(output.prompt_logprobs, prompt_ids, reference, 1)


def test_n_sequences_share_one_set_of_prompt_logprobs(llm: LLM, reference: PreTrainedModel) -> None:
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[1])
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=2, prompt_logprobs=1)
    (output,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    assert len(output.outputs) == 3
    assert_matches_reference(output.prompt_logprobs, prompt_ids, reference, 1)


def test_a_one_token_prompt_has_a_single_none() -> None:
    group = RequestGroup("r", None, [5], [], RequestMetrics(0.0), prompt_logprobs=[None])
    assert group.output().prompt_logprobs == [None]


def test_recomputed_positions_after_a_preemption_are_kept_once() -> None:
    group = RequestGroup("r", None, [1, 2, 3, 4], [], RequestMetrics(0.0), prompt_logprobs=[None])
    first = PromptLogprobsChunk(1, [{2: Logprob(-1.0, 1)}, {3: Logprob(-2.0, 1)}])
    again = PromptLogprobsChunk(
        1, [{2: Logprob(-1.0, 1)}, {3: Logprob(-2.0, 1)}, {4: Logprob(-3.0, 2)}]
    )
    group.add_prompt_logprobs(first, lambda ids: f"<{ids[0]}>")
    group.add_prompt_logprobs(again, lambda ids: f"<{ids[0]}>")
    held = group.output().prompt_logprobs
    assert held is not None
    assert [None if e is None else list(e) for e in held] == [None, [2], [3], [4]]
    assert held[3] == {4: Logprob(-3.0, 2, "<4>")}
    with pytest.raises(ValueError, match="out of order"):
        group.add_prompt_logprobs(PromptLogprobsChunk(6, [{9: Logprob(-1.0, 1)}]), str)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_prompt_logprobs_out_of_range_is_refused_by_name(value: object) -> None:
    with pytest.raises(
        InvalidParameterError, match=r"prompt_logprobs.*\[0, 20\]|prompt_logprobs.*integer"
    ):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_prompt_logprobs_survive_preemption_and_recompute(
    tiny_model_dir: Path, reference: PreTrainedModel
) -> None:
    # A pool of a few blocks: the requests' growing outputs preempt one another, and a
    # preempted request computes its prompt again (sending positions it sent before).
    tight = LLM(
        str(tiny_model_dir),
        dtype="float32",
        block_size=16,
        num_blocks=7,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    tokenizer = tight.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outputs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None
        assert_matches_reference(output.prompt_logprobs, tokenizer.encode(prompt), reference, 1)
