"""VocabEmbedding: a float table behaves as nn.Embedding; a quantized one stays in its blocks.

References are independent of the layer: ``nn.Embedding`` for float tables,
and gguf's own numpy dequantizer run over the whole quantized table (then
indexed) for quantized lookups and the tied LM head.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from kvserve.attention import get_attention_backend
from kvserve.kernels import native_ops
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.layers.embedding import VocabEmbedding
from kvserve.loader.quantize import quantize_weights
from kvserve.models.arch_config import ArchConfig
from kvserve.models.registry import build_model
from model_fixtures import tiny_hf_config

VOCAB, DIM = 200, 64
EPS32 = float(torch.finfo(torch.float32).eps)
TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_1]


def quantized_table(qtype: GGMLQuantizationType, seed: int = 0) -> QuantizedTensor:
    values = np.random.default_rng(seed).normal(0.0, 0.5, (VOCAB, DIM)).astype(np.float32)
    data = torch.from_numpy(np.ascontiguousarray(quantize(values, qtype)))
    return QuantizedTensor(qtype, VOCAB, DIM, data)


def reference_table(table: QuantizedTensor) -> torch.Tensor:
    """The whole table through gguf's dequantizer, float32 [VOCAB, DIM]."""
    values = dequantize(table.data.numpy(), table.qtype).reshape(VOCAB, DIM)
    return torch.from_numpy(np.ascontiguousarray(values)).float()


def kernels_with(name: str) -> object | None:
    """The C kernels when they build here and offer ``name`` (they may predate it)."""
    ops = native_ops()
    return ops if ops is not None and hasattr(ops, name) else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_table_looks_up_as_nn_embedding(dtype: torch.dtype) -> None:
    table = torch.randn(VOCAB, DIM).to(dtype)
    layer = VocabEmbedding(VOCAB, DIM, dtype)
    layer.load("weight", table)
    reference = nn.Embedding.from_pretrained(table, freeze=True)
    ids = torch.tensor([[0, 5, 199], [7, 7, 3]])
    assert torch.equal(layer(ids), reference(ids))
    assert layer(ids).dtype == dtype
    assert not layer.quantized
    with pytest.raises(IndexError):
        layer(torch.tensor([VOCAB]))


def test_a_float_table_of_another_shape_is_refused() -> None:
    layer = VocabEmbedding(VOCAB, DIM)
    with pytest.raises(ValueError, match="shape"):
        layer.load("weight", torch.zeros(VOCAB, DIM + 1))
    with pytest.raises(ValueError, match="shape"):
        layer.load("weight", quantized_table(GGMLQuantizationType.Q8_0).take_rows(slice(0, 10)))
    assert not layer.quantized


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("use_kernels", [False, True], ids=["numpy", "kernels"])
def test_a_quantized_lookup_is_gguf_dequantize_of_those_rows(
    qtype: GGMLQuantizationType, use_kernels: bool
) -> None:
    native = kernels_with("dequant_rows") if use_kernels else None
    if use_kernels and native is None:
        pytest.skip("the C kernels here have no dequant_rows")
    table = quantized_table(qtype)
    layer = VocabEmbedding(VOCAB, DIM, torch.float32)
    layer.load("weight", table)
    layer.native = native  # type: ignore[assignment]
    assert layer.quantized
    # The float table is let go of: only the blocks stay.
    assert layer.weight.numel() == 0
    ids = torch.tensor([[3, 0, 199, 3], [150, 42, 1, 77]])
    expected = reference_table(table)[ids]
    assert torch.equal(layer(ids), expected)
    with pytest.raises((IndexError, ValueError)):
        layer(torch.tensor([0, VOCAB]))


def test_a_quantized_lookup_returns_the_models_dtype() -> None:
    table = quantized_table(GGMLQuantizationType.Q8_0)
    layer = VocabEmbedding(VOCAB, DIM, torch.bfloat16)
    layer.load("weight", table)
    ids = torch.tensor([9, 8, 7])
    out = layer(ids)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference_table(table)[ids].to(torch.bfloat16))


def linear_quant_bound(hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """What the kernels may differ from the exact product by: they round each block
    of 32 activations to int8 (half a step, the block's largest magnitude / 127 / 2,
    times the block's weights' magnitudes), plus float32 accumulation."""
    n, k = hidden.shape
    blocks = hidden.double().abs().view(n, k // 32, 32)
    half_steps = blocks.amax(-1) / 127 / 2  # [N, K / 32]
    weight_sums = table.double().abs().view(table.shape[0], k // 32, 32).sum(-1)  # [V, K / 32]
    magnitudes = hidden.double().abs() @ table.double().abs().T
    return half_steps @ weight_sums.T * (1 + 1e-4) + 4 * k * EPS32 * magnitudes + 1e-30


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("use_kernels", [False, True], ids=["numpy", "kernels"])
def test_logits_multiply_by_the_quantized_table(
    qtype: GGMLQuantizationType, use_kernels: bool
) -> None:
    native = kernels_with("linear_quant") if use_kernels else None
    if use_kernels and native is None:
        pytest.skip("the C kernels here have no linear_quant")
    table = quantized_table(qtype)
    layer = VocabEmbedding(VOCAB, DIM)
    layer.load("weight", table)
    layer.native = native  # type: ignore[assignment]
    hidden = torch.randn(5, DIM)
    exact = hidden.double() @ reference_table(table).double().T
    logits = layer.logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, VOCAB)
    if native is None:
        # F.linear on the dequantized table: float32 accumulation only.
        bound = DIM * EPS32 * (hidden.double().abs() @ reference_table(table).double().abs().T)
    else:
        bound = linear_quant_bound(hidden, reference_table(table))
    error = (logits.double() - exact).abs()
    assert bool((error <= bound + 1e-30).all()), float((error / (bound + 1e-30)).max())


def tied_config() -> Any:
    """SmolLM2's kind: a Llama with tied embeddings, here tiny."""
    config = tiny_hf_config("llama", VOCAB, hidden_size=DIM)
    config.tie_word_embeddings = True
    return config


def tied_arch() -> ArchConfig:
    return ArchConfig.from_hf_dict(tied_config().to_dict())


def tiny_checkpoint(arch: ArchConfig) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(0)
    config = tied_config()
    state = transformers.LlamaForCausalLM(config).state_dict()
    state.pop("lm_head.weight")
    return {name: tensor.clone() for name, tensor in state.items()}


def test_a_tied_head_multiplies_by_the_quantized_embedding_table() -> None:
    arch = tied_arch()
    backend = get_attention_backend(
        "torch_paged",
        torch.float32,
        torch.device("cpu"),
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    model = build_model(arch, 64, torch.float32, backend)
    checkpoint = tiny_checkpoint(arch)
    model.load_weights(quantize_weights(checkpoint.items(), "q8_0", arch))
    embedding = model.model.embed_tokens
    assert embedding.quantized and embedding.weight.numel() == 0
    # The float head that shared the table is gone with it.
    assert not hasattr(model, "lm_head")
    assert not any(p.shape == (VOCAB, DIM) for p in model.parameters())
    assert embedding.qweight is not None
    data = embedding.qweight.segments[0].data
    table = QuantizedTensor(GGMLQuantizationType.Q8_0, VOCAB, DIM, data)
    hidden = torch.randn(3, DIM)
    logits = model.compute_logits(hidden)
    exact = hidden.double() @ reference_table(table).double().T
    bound = DIM * EPS32 * (hidden.double().abs() @ reference_table(table).double().abs().T)
    assert bool(((logits.double() - exact).abs() <= bound + 1e-30).all())


def test_a_tied_float_table_keeps_the_shared_head() -> None:
    arch = tied_arch()
    backend = get_attention_backend(
        "torch_paged",
        torch.float32,
        torch.device("cpu"),
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    model = build_model(arch, 64, torch.float32, backend)
    checkpoint = tiny_checkpoint(arch)
    model.load_weights(checkpoint.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(3, DIM)
    expected = hidden @ checkpoint["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden), expected)
