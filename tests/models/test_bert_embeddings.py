"""all-MiniLM-L6-v2 through kvserve against transformers' BertModel on the same files.

The reference is computed here, independently of kvserve: transformers'
``BertModel`` on the folder's safetensors, pooled as the folder's
sentence-transformers files say (read here with ``json``), which is what
sentence-transformers itself does (it is not installed). Thirty-two varied
sentences, short and long, with punctuation, digits, accents and code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM
from kvserve.errors import InvalidParameterError
from kvserve.loader import resolve_model
from kvserve.pooling_params import PoolingParams

pytestmark = pytest.mark.slow

MODEL = "all-minilm-l6-v2"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome!",
    "The cat sits outside",
    "I love pasta",
    "Do you like pizza?",
    "Hi",
    "What's the weather like in Zürich on 3 March 2024, around 14:00?",
    "Café crème, naïve façade, résumé.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Interest rates rose by 0.25 percentage points, the fourth increase this year.",
    "Please reset my password; I can't log in since yesterday.",
    "The mitochondria is the powerhouse of the cell.",
    "In 1969, Apollo 11 landed on the Moon and Neil Armstrong walked on its surface.",
    "How do I install a Python package without its dependencies?",
    "Retrieval augmented generation combines search with a language model.",
    "¿Dónde está la biblioteca?",
    "emoji test 🙂 and symbols ©®™ $€£",
    "a",
    "THIS SENTENCE IS WRITTEN ENTIRELY IN CAPITAL LETTERS FOR EMPHASIS",
    "Long sentence: " + " ".join(f"word{i}" for i in range(45)),
    "The meeting was moved to Thursday because the projector broke.",
]


def _folder() -> Path:
    return resolve_model(MODEL).path


def _reference(sentences: list[str], max_length: int | None = None) -> torch.Tensor:
    """Vectors from transformers' BertModel, pooled as modules.json and 1_Pooling say."""
    from transformers import AutoTokenizer, BertModel

    folder = _folder()
    modules = json.loads((folder / "modules.json").read_text())
    pooling_path = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
    pooling = json.loads((folder / pooling_path / "config.json").read_text())
    normalize = any(m["type"].endswith("Normalize") for m in modules)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    batch = tokenizer(
        sentences,
        padding=True,
        truncation=max_length is not None,
        max_length=max_length,
        return_tensors="pt",
    )
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()
    mask = batch["attention_mask"][..., None].double()
    if pooling["pooling_mode_mean_tokens"]:
        vectors = (hidden * mask).sum(1) / mask.sum(1)
    else:
        assert pooling["pooling_mode_cls_token"]
        vectors = hidden[:, 0]
    return F.normalize(vectors, dim=-1) if normalize else vectors


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return _reference(SENTENCES)


@pytest.fixture(scope="module")
def llm_f32() -> LLM:
    return LLM(MODEL, dtype="float32")


def _vectors(outputs: list[Any]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs], dtype=torch.float64)


def test_float32_vectors_match_transformers(llm_f32: LLM, reference: torch.Tensor) -> None:
    vectors = _vectors(llm_f32.embed(SENTENCES, use_tqdm=False))
    assert vectors.shape == (len(SENTENCES), 384)
    cosine = F.cosine_similarity(vectors, reference, dim=-1)
    assert cosine.min().item() >= 0.9999, cosine
    # Normalised, as the folder's Normalize module says.
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(len(SENTENCES), dtype=torch.float64))


def test_bfloat16_vectors_match_transformers(reference: torch.Tensor) -> None:
    llm = LLM(MODEL, dtype="bfloat16")
    vectors = _vectors(llm.embed(SENTENCES, use_tqdm=False))
    cosine = F.cosine_similarity(vectors, reference, dim=-1)
    assert cosine.min().item() >= 0.999, cosine


def test_batched_equals_alone(llm_f32: LLM) -> None:
    batched = _vectors(llm_f32.embed(SENTENCES, use_tqdm=False))
    alone = torch.cat([_vectors(llm_f32.embed([s], use_tqdm=False)) for s in SENTENCES[:8]])
    assert torch.allclose(batched[:8], alone, atol=1e-5), (batched[:8] - alone).abs().max()


def test_output_shape_is_vllms(llm_f32: LLM) -> None:
    (output,) = llm_f32.embed("Hello world", use_tqdm=False)
    tokenizer = llm_f32.get_tokenizer()
    assert output.prompt_token_ids == tokenizer("Hello world")["input_ids"]
    assert output.finished and output.outputs.hidden_size == 384


def test_token_id_prompts_match_text(llm_f32: LLM) -> None:
    ids = llm_f32.get_tokenizer()(SENTENCES[0])["input_ids"]
    from_ids = _vectors(llm_f32.embed({"prompt_token_ids": ids}, use_tqdm=False))
    from_text = _vectors(llm_f32.embed(SENTENCES[0], use_tqdm=False))
    assert torch.allclose(from_ids, from_text, atol=1e-6)


def test_too_long_is_refused_or_truncated(llm_f32: LLM) -> None:
    # max_seq_length is 256 in sentence_bert_config.json.
    text = " ".join(["token"] * 300)
    with pytest.raises(InvalidParameterError) as refused:
        llm_f32.embed(text, use_tqdm=False)
    assert refused.value.param == "prompt" and "256" in refused.value.message
    assert llm_f32.llm_engine.scheduler.num_waiting == 0  # nothing was queued
    truncated = _vectors(llm_f32.embed(text, truncate_prompt_tokens=64, use_tqdm=False))
    reference = _reference([text], max_length=64)
    assert F.cosine_similarity(truncated, reference).item() >= 0.9999
    (whole,) = llm_f32.embed(text, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert len(whole.prompt_token_ids) == 256


def test_bad_requests_name_the_parameter(llm_f32: LLM) -> None:
    with pytest.raises(InvalidParameterError) as dims:
        llm_f32.embed("hello", PoolingParams(dimensions=128), use_tqdm=False)
    assert dims.value.param == "dimensions" and "384" in dims.value.message
    (full,) = llm_f32.embed("hello", PoolingParams(dimensions=384), use_tqdm=False)
    assert full.outputs.hidden_size == 384
    with pytest.raises(InvalidParameterError) as bad_truncate:
        PoolingParams(truncate_prompt_tokens=0)
    assert bad_truncate.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidParameterError) as too_far:
        llm_f32.embed("hello", truncate_prompt_tokens=1000, use_tqdm=False)
    assert too_far.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidParameterError) as generating:
        llm_f32.generate("hello", use_tqdm=False)
    assert generating.value.param == "model"
    with pytest.raises(InvalidParameterError) as bad_id:
        llm_f32.embed([[101, 10**6, 102]], use_tqdm=False)
    assert bad_id.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as empty:
        llm_f32.embed("", use_tqdm=False)
    assert empty.value.param == "prompt"
    assert not llm_f32.llm_engine.has_unfinished_requests()


def test_encoder_keeps_no_blocks_after_its_step(llm_f32: LLM) -> None:
    engine = llm_f32.llm_engine
    llm_f32.embed(SENTENCES, use_tqdm=False)
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_usable_blocks
    assert engine.runner.kv_cache.numel() == 0  # the encoder's pool holds no memory at all
    assert engine.runner.fast_path is None  # nothing to decode


def test_generation_task_is_refused_for_an_encoder() -> None:
    with pytest.raises(InvalidParameterError) as refused:
        LLM(MODEL, task="generate")
    assert refused.value.param == "task"


@pytest.mark.parametrize("bf16_units", [False, True])
def test_auto_keeps_an_encoder_in_float32_without_bf16_units(
    bf16_units: bool, monkeypatch: pytest.MonkeyPatch, reference: torch.Tensor
) -> None:
    """An encoder computes whole prompts: without bf16 units its weights stay float32 (BLAS
    multiplies them faster than the C kernels widen bf16); with them, bf16 as for any model."""
    from kvserve.config import dtype

    monkeypatch.setattr(dtype, "cpu_has_native_bf16", lambda: bf16_units)
    llm = LLM(MODEL)
    described = llm.llm_engine.runner.describe_precision()
    assert described.startswith("bfloat16 weights") if bf16_units else described == "float32"
    cosine = F.cosine_similarity(_vectors(llm.embed(SENTENCES, use_tqdm=False)), reference)
    assert cosine.min().item() >= (0.999 if bf16_units else 0.9999), cosine


def test_q8_0_encoder_vectors_match_transformers(reference: torch.Tensor) -> None:
    """``quantization="q8_0"`` quantizes the encoder's six projections a layer (int8
    products with int8 activations): the vectors stay within 0.999 of float32's."""
    llm = LLM(MODEL, quantization="q8_0")
    assert llm.llm_engine.runner.describe_precision().startswith("Q8_0 blocks")
    cosine = F.cosine_similarity(_vectors(llm.embed(SENTENCES, use_tqdm=False)), reference)
    assert cosine.min().item() >= 0.999, cosine
