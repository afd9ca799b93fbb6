"""Pre-packed bf16 weights compute exactly what the plain layout computes.

Packing is the bf16 path of CPUs with bf16 units when kvserve's C kernels are
off; the engine tests below turn them off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvserve.worker.platform.cpu as cpu_platform
from kvserve import LLM, SamplingParams
from kvserve.layers.linear import Linear
from kvserve.layers.weight_format import PackedBF16Weights
from kvserve.worker.cpu_weights import can_prepack, prepack_linear_weights
from model_fixtures import save_tiny_model, train_tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.bfloat16, torch.device("cpu")),
    reason="this CPU has no native bf16 matrix units; weights are never packed here",
)


@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_linear_equals_plain_linear(num_rows: int) -> None:
    torch.manual_seed(0)
    layer = Linear(96, shards={"a": 64, "b": 160}, bias=True, dtype=torch.bfloat16)
    layer.weight.data.normal_()
    assert layer.bias is not None
    layer.bias.data.normal_()
    plain_weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(num_rows, 96).to(torch.bfloat16)
    assert prepack_linear_weights(layer) == 1
    assert isinstance(layer.format, PackedBF16Weights)
    torch.testing.assert_close(layer(x), F.linear(x, plain_weight, bias), rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        layer.load("weight", plain_weight)


@pytest.fixture
def without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_platform, "native_ops", lambda: None)


@pytest.mark.usefixtures("without_kernels")
def test_tied_embedding_keeps_its_plain_layout(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path, "qwen2", train_tiny_tokenizer())  # tied embeddings
    llm = LLM(str(folder), dtype="bfloat16", num_blocks=64)
    model = llm.llm_engine.runner.model
    assert isinstance(model.lm_head.format, PackedBF16Weights)
    assert model.lm_head.weight is not model.model.embed_tokens.weight


@pytest.mark.usefixtures("without_kernels")
def test_engine_tokens_are_the_same_with_and_without_packing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9][: n + 1] * 3} for n in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    packed = LLM(str(folder), dtype="bfloat16", num_blocks=64).generate(
        prompts, params, use_tqdm=False
    )
    monkeypatch.setattr(cpu_platform, "can_prepack", lambda *args: False)
    plain_llm = LLM(str(folder), dtype="bfloat16", num_blocks=64)
    assert not isinstance(plain_llm.llm_engine.runner.model.lm_head.format, PackedBF16Weights)
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(packed, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
