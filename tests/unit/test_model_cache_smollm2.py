"""The real SmolLM2 GGUF through the converted-model cache: same tokens, same logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import ModelLoadError
from kvserve.loader import CachedWeights, WeightOrigin, load_arch_config, resolve_model

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about caches."}],
]


def test_generations_from_cached_weights_match_the_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        source = resolve_model("smollm2-135m-instruct")
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    def generate() -> tuple[LLM, list[tuple[list[int], object]]]:
        # The cache holds dequantized weights: only a load that dequantizes uses it.
        llm = LLM(
            "smollm2-135m-instruct",
            dtype="float32",
            num_blocks=64,
            max_model_len=256,
            quantization="none",
        )
        outputs = llm.chat(CONVERSATIONS, params, use_tqdm=False)
        return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    uncached_llm, uncached = generate()  # the cache is off in tests unless turned on
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "1")
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_DIR", raising=False)
    building = CachedWeights(source, load_arch_config(source), torch.float32)
    assert sum(1 for _ in building) > 0
    assert building.origin is WeightOrigin.SOURCE_CACHED
    cached_llm, cached = generate()
    assert cached_llm.llm_engine.runner.weights_origin is WeightOrigin.CACHE
    assert cached == uncached
    tokenizer, cached_tokenizer = uncached_llm.get_tokenizer(), cached_llm.get_tokenizer()
    assert cached_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert cached_tokenizer.chat_template == tokenizer.chat_template
    assert cached_tokenizer.all_special_tokens == tokenizer.all_special_tokens
