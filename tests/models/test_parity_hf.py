"""kvserve computes what Hugging Face transformers computes, on the same weights.

Tiny random Llama (with Llama 3 RoPE scaling), Qwen2 (q/k/v bias, tied
embeddings), Qwen3 (q/k norm, head_dim != hidden/heads) and GPT-2 (learned
positions, LayerNorm, GELU, Conv1D weights, tied head) checkpoints are built
with transformers; each prompt's reference logits come from running it alone
through the transformers model.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from kvserve import LLM, SamplingParams
from kvserve.core.request import Request
from kvserve.core.scheduler import ScheduledRequest
from kvserve.engine import LLMEngine
from kvserve.kernels import NativeOps
from kvserve.kernels.build import load_library
from kvserve.worker.input_batch import prepare_inputs
from kvserve.worker.platform import cpu as cpu_platform
from model_fixtures import (
    TINY_KINDS,
    reference_greedy,
    save_tiny_model,
    tiny_pool,
    train_tiny_tokenizer,
)

PROMPT_LENGTHS = (1, 5, 13, 37, 64)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tiny_tokenizer()
    return {
        kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer) for kind in TINY_KINDS
    }


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def engine_logits(
    engine: LLMEngine, prompts: list[list[int]], chunk_size: int | None
) -> list[torch.Tensor]:
    """Logits at every prompt position, all prompts in one flat batch per step.

    With ``chunk_size`` each prompt advances at most that many tokens per
    step, so later chunks attend to K/V already in the paged cache.
    """
    manager = engine.kv_cache_manager
    requests = [Request(f"p{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    collected: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
    while any(r.num_computed_tokens < r.num_tokens for r in requests):
        scheduled = []
        for request in requests:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining:
                num_new = min(remaining, chunk_size or remaining)
                assert manager.allocate_slots(request, num_new) is not None
                block_ids = manager.get_block_ids(request.request_id)
                scheduled.append(ScheduledRequest(request, num_new, block_ids, samples=False))
        inputs = prepare_inputs(
            scheduled, engine.runner.block_size, torch.device("cpu"), engine.runner.sliding_windows
        )
        with torch.inference_mode():
            hidden = engine.runner.forward(inputs)
            logits = engine.runner.model.compute_logits(hidden)
        start = 0
        for item in inputs.scheduled:
            collected[item.request.request_id].append(logits[start : start + item.num_new_tokens])
            start += item.num_new_tokens
            item.request.num_computed_tokens += item.num_new_tokens
    for request in requests:
        manager.free(request)
    return [torch.cat(collected[r.request_id]) for r in requests]


@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("chunk_size", [None, 7, 1])
def test_logits_match_transformers(
    tiny_models: dict[str, Path], kind: str, chunk_size: int | None
) -> None:
    folder = tiny_models[kind]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_engine_args(
        str(folder), dtype="float32", num_blocks=tiny_pool(128, kind), block_size=4
    )
    prompts = random_prompts(reference.config.vocab_size)
    ours = engine_logits(engine, prompts, chunk_size)
    for prompt, logits in zip(prompts, ours, strict=True):
        expected = reference_logits(reference, prompt)
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


# How the engine runs the prompts: all at once in a roomy pool; prefill in chunks of at
# most 16 tokens a step; or in a pool so small that requests are preempted and recomputed.
GENERATION_SETTINGS = {
    "batched": dict(num_blocks=256),
    "chunked": dict(num_blocks=256, max_num_batched_tokens=16, max_num_seqs=8),
    # The 5 requests need 9 to 24 blocks of 4 tokens each, 73 in all; 32 usable cannot hold them.
    "preempted": dict(num_blocks=33),
}


@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("setting", GENERATION_SETTINGS)
def test_greedy_generation_matches_transformers(
    tiny_models: dict[str, Path], kind: str, setting: str
) -> None:
    folder = tiny_models[kind]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    settings = dict(GENERATION_SETTINGS[setting])
    settings["num_blocks"] = tiny_pool(settings["num_blocks"], kind)
    if kind == "mistral" and setting == "preempted":
        # Every layer slides (window 16), so a request holds at most its window plus one
        # 16-token prompt chunk: about 9 blocks. 12 usable admit each alone, not all five.
        settings.update(num_blocks=13, max_num_batched_tokens=16, max_num_seqs=8)
    llm = LLM(str(folder), dtype="float32", block_size=4, **settings)
    prompts = random_prompts(reference.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 32)
    assert (llm.llm_engine.scheduler.num_preemptions_total > 0) == (setting == "preempted")


def round_linear_weights_to_bf16(model: PreTrainedModel) -> None:
    """What kvserve's bf16-weight mode computes: linear weights rounded to bf16, math in float32.

    A tied LM head is untied first, so the embedding keeps its float32 values
    as it does in kvserve. GPT-2's Conv1D layers are linear layers stored transposed.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear | Conv1D):
                rounded = module.weight.detach().to(torch.bfloat16).float()
                module.weight = torch.nn.Parameter(rounded, requires_grad=False)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_bf16_weights_with_float32_math_match_transformers_on_the_same_rounding(
    tiny_models: dict[str, Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The portable kernel widens bf16 weights exactly and a float32 pool stores K/V as
    # they are: then only the weights' rounding separates kvserve from float32 math.
    lib = load_library()
    if lib is None:
        pytest.skip("bf16 weights with float32 math needs the C kernels")
    portable = NativeOps(lib, bf16_dot=False)
    monkeypatch.setattr(cpu_platform, "native_ops", lambda: portable)
    folder = tiny_models[kind]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    round_linear_weights_to_bf16(reference)
    engine = LLMEngine.from_engine_args(
        str(folder),
        dtype="bfloat16",
        kv_cache_dtype="float32",
        num_blocks=tiny_pool(128, kind),
        block_size=4,
    )
    assert engine.runner.describe_precision() == (
        "bfloat16 weights, float32 compute, float32 KV cache"
    )
    prompts = random_prompts(reference.config.vocab_size, seed=2)
    for prompt, logits in zip(prompts, engine_logits(engine, prompts, 7), strict=True):
        torch.testing.assert_close(logits, reference_logits(reference, prompt), atol=1e-4, rtol=0)
    # And the rounding matters: the unrounded model's logits are measurably different.
    unrounded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gap = (
        reference_logits(unrounded, prompts[-1]) - reference_logits(reference, prompts[-1])
    ).abs()
    assert gap.max() > 1e-3


# bf16 end to end (bf16 weights and KV pool; float32 math with AVX512-BF16 rows rounded to
# bf16 where the CPU has it) against transformers in bf16: logprobs may differ by this much
# on the tiny random models, whose bf16 rounding moves logprobs by up to ~0.15 either way.
BF16_LOGPROB_ATOL = 0.3


@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("chunk_size", [None, 7, 1])
def test_bf16_end_to_end_logprobs_match_transformers_bf16(
    tiny_models: dict[str, Path], kind: str, chunk_size: int | None
) -> None:
    folder = tiny_models[kind]
    exact = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    engine = LLMEngine.from_engine_args(
        str(folder), dtype="bfloat16", num_blocks=tiny_pool(128, kind), block_size=4
    )
    assert engine.runner.kv_cache_dtype == torch.bfloat16
    prompts = random_prompts(exact.config.vocab_size, seed=3)
    ours_error = reference_error = 0.0
    for prompt, logits in zip(prompts, engine_logits(engine, prompts, chunk_size), strict=True):
        ours = logits.log_softmax(-1)
        theirs = reference_logits(reference, prompt).log_softmax(-1)
        truth = reference_logits(exact, prompt).log_softmax(-1)
        torch.testing.assert_close(ours, theirs, atol=BF16_LOGPROB_ATOL, rtol=0)
        top2 = theirs.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > BF16_LOGPROB_ATOL
        assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
        ours_error = max(ours_error, (ours - truth).abs().max().item())
        reference_error = max(reference_error, (theirs - truth).abs().max().item())
    # Float32 activations keep kvserve's bf16 at least as close to float32 as transformers'.
    assert ours_error <= 1.1 * reference_error
