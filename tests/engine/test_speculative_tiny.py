"""Speculative decoding on tiny random models: Llama (one KV cache group) and Gemma 3
(sliding-window groups whose blocks are given back as the window moves).

Greedy outputs must equal those without speculation (a divergence only at a
genuine near-tie: ``greedy_checks.py``); prompts repeat a pattern so that
proposals exist, and a random model's greedy output often loops, so that some
are accepted. The pool must be whole at the end.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from greedy_checks import assert_same_tokens
from kvserve import LLM, SamplingParams, StructuredOutputsParams
from model_fixtures import save_tiny_model, train_tiny_tokenizer

NEAR_TIE = 1e-4
# Every decoding request proposes (not adaptive): what the tests count never depends
# on how long steps took.
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tiny_tokenizer()
    return {
        kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer)
        for kind in ("llama", "gemma3")
    }


def prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(7)
    result = []
    for _ in range(6):
        pattern = [rng.randrange(3, 300) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(3, 300) for _ in range(rng.randint(0, 9))]
        result.append({"prompt_token_ids": noise + pattern * rng.randint(2, 8)})
    return result


def run(model_dir: Path, speculative: bool, **engine_args: Any) -> tuple[LLM, list[Any]]:
    args: dict[str, Any] = dict(dtype="float32", block_size=4, num_blocks=256)
    args.update(engine_args)
    if speculative:
        args["speculative_config"] = SPEC
    llm = LLM(str(model_dir), **args)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts(), params, use_tqdm=False)  # type: ignore[arg-type]
    return llm, [output.outputs[0] for output in outputs]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "engine_args",
    [{}, {"num_blocks": 40, "max_num_batched_tokens": 16, "max_num_seqs": 4}],
    ids=["roomy", "chunked-and-preempted"],
)
def test_greedy_output_is_unchanged(
    model_dirs: dict[str, Path], kind: str, engine_args: dict[str, Any]
) -> None:
    if engine_args and kind == "gemma3":
        # Several KV cache groups: a sequence holds a block per group and window.
        engine_args = {**engine_args, "num_blocks": 110}
    _, want = run(model_dirs[kind], False, **engine_args)
    llm, got = run(model_dirs[kind], True, **engine_args)
    for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
        assert_same_tokens(expected, actual, f"{kind} prompt {index}", NEAR_TIE)
    engine = llm.llm_engine
    assert engine.stats.num_spec_accepted_tokens > 0
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    if engine_args:
        assert engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("backend", ["torch_paged", "flex"])
def test_each_backend_attends_verification_rows_as_decodes(
    model_dirs: dict[str, Path], kind: str, backend: str
) -> None:
    """Verifications are decode rows (``input_batch.py``): each backend's decode path must
    let a row see the proposals before it, which it reads back from the pool."""
    _, want = run(model_dirs[kind], False, attention_backend=backend)
    llm, got = run(model_dirs[kind], True, attention_backend=backend)
    for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
        assert_same_tokens(expected, actual, f"{kind} {backend} prompt {index}", NEAR_TIE)
    assert llm.llm_engine.stats.num_spec_accepted_tokens > 0


def test_constrained_requests_beside_verifying_ones(model_dirs: dict[str, Path]) -> None:
    """A request with a grammar gets no proposals, and samples as it would without them,
    in the same steps as requests that verify proposals."""
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    constrained = SamplingParams(
        temperature=0,
        max_tokens=30,
        logprobs=2,
        structured_outputs=StructuredOutputsParams(regex=phone),
    )
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    batch = prompts()[:3]
    params = [constrained, free, free]
    results = []
    for speculative in (False, True):
        args: dict[str, Any] = dict(dtype="float32", block_size=4, num_blocks=256)
        if speculative:
            args["speculative_config"] = SPEC
        llm = LLM(str(model_dirs["llama"]), **args)
        outputs = llm.generate(batch, params, use_tqdm=False)  # type: ignore[arg-type]
        results.append([output.outputs[0] for output in outputs])
    want, got = results
    assert re.fullmatch(phone, got[0].text), got[0].text
    for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
        assert_same_tokens(expected, actual, f"prompt {index}", NEAR_TIE)
    assert llm.llm_engine.stats.num_spec_accepted_tokens > 0
