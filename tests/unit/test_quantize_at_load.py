"""--quantization q8_0|q4_0|q4_k: which checkpoint tensors are quantized, and how closely.

The roundtrip bound is each format's own step, read from the blocks the
quantizer wrote: round to nearest puts every value within half a step of
its code, d / 2 for Q8_0 and Q4_0 (d each block's scale). Q4_0's one-sided
range ([-8, 7] d, its largest magnitude at -8 d) cannot round the opposite
extreme to +8 d, which clips to 7 d: those values are within one step.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.config import EngineConfig, ModelConfig
from kvserve.errors import InvalidParameterError
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.loader import iter_weights, load_arch_config, resolve_model
from kvserve.loader.quantize import quantize_tensor, quantize_weights
from kvserve.models.arch_config import ArchConfig
from model_fixtures import save_tiny_model, tiny_hf_config, train_tiny_tokenizer


def block_scales(tensor: QuantizedTensor) -> torch.Tensor:
    """Each block's scale d (the float16 that opens Q8_0 and Q4_0 blocks), float32
    ``[rows, blocks]``, read straight from the bytes."""
    block_bytes = GGML_QUANT_SIZES[tensor.qtype][1]
    blocks = tensor.data.numpy().reshape(tensor.rows, -1, block_bytes)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0]
    return torch.from_numpy(scales.astype(np.float32))


@pytest.mark.parametrize("qname", ["q8_0", "q4_0"])
def test_every_value_is_within_half_a_step_of_its_code(qname: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 256) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of all sizes
    quantized = quantize_tensor(weight, qname)
    assert quantized.qtype.name.lower() == qname and quantized.shape == (48, 256)
    blocks = weight.double().view(48, -1, 32)
    error = (quantized.dequantize().double().view(48, -1, 32) - blocks).abs()
    # The step each block should have: Q8_0 maps its largest magnitude to 127 codes,
    # Q4_0 its largest-magnitude value (with its sign) to -8.
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    ideal = largest.abs() / 127 if qname == "q8_0" else largest / -8
    stored = block_scales(quantized).double().unsqueeze(-1)  # d, rounded to float16
    max_code = 127 if qname == "q8_0" else 8
    # Half a step, plus what rounding d to float16 moves the furthest code.
    bound = stored.abs() / 2 + max_code * (stored - ideal).abs() + 1e-7 * blocks.abs()
    if qname == "q8_0":
        assert bool((error <= bound).all()), float((error / bound).max())
    else:
        # Q4_0's codes reach -8 d but only +7 d: values past +7.5 d clip to 7 d.
        past_top = blocks / stored > 7.5
        assert bool((error[~past_top] <= bound.expand_as(error)[~past_top]).all())
        assert bool((error <= bound + stored.abs() / 2).all())


def test_bfloat16_weights_are_quantized_from_their_values() -> None:
    weight = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(
        quantize_tensor(weight, "q8_0").data, quantize_tensor(weight.float(), "q8_0").data
    )


def test_q4_k_rows_576_wide_fall_back_to_q8_0(caplog: pytest.LogCaptureFixture) -> None:
    # SmolLM2's hidden size: 576 is 18 blocks of 32, not whole blocks of 256.
    weight = torch.randn(8, 576)
    with caplog.at_level(logging.INFO, logger="kvserve.loader.quantize"):
        quantized = quantize_tensor(weight, "q4_k")
    assert quantized.qtype == GGMLQuantizationType.Q8_0
    assert torch.equal(quantized.data, quantize_tensor(weight, "q8_0").data)
    assert "Q8_0" in caplog.text and "576" in caplog.text


def test_q4_k_quantizes_whole_blocks_of_256() -> None:
    pytest.importorskip("kvserve.kernels.quant_k_ops")
    from kvserve.kernels import native_ops

    if native_ops() is None:
        pytest.skip("the C kernels do not build here")
    torch.manual_seed(1)
    weight = torch.randn(16, 512)
    quantized = quantize_tensor(weight, "q4_k")
    assert quantized.qtype == GGMLQuantizationType.Q4_K
    # Q4_K: 8 sub-blocks of 32 per block, each with a 6-bit scale and min under the block's
    # float16 d and dmin; the step of 4-bit codes is at most 2 * range / 15 of a sub-block
    # (a 6-bit scale rounds the step up to twice its ideal at worst).
    error = (quantized.dequantize() - weight).abs().view(16, -1, 32)
    spans = weight.view(16, -1, 32)
    value_range = spans.amax(-1) - spans.amin(-1).clamp(max=0)
    assert bool((error <= (value_range / 15).unsqueeze(-1) * 1.01).all())


@pytest.mark.parametrize(
    ("weight", "qname", "match"),
    [
        (torch.randn(4, 64), "q5_0", "quantization"),
        (torch.randn(4, 48), "q8_0", "32"),
        (torch.randn(64), "q8_0", "matrices"),
        (torch.zeros(4, 64, dtype=torch.int32), "q8_0", "matrices"),
    ],
)
def test_what_cannot_be_quantized_is_refused(weight: torch.Tensor, qname: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize_tensor(weight, qname)


def smollm2_shaped_llama() -> tuple[ArchConfig, dict[str, torch.Tensor]]:
    """A tiny Llama with SmolLM2's structure (tied embeddings), as transformers stores it."""
    config = tiny_hf_config("llama", 128)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(config).state_dict()
    state.pop("lm_head.weight")
    return ArchConfig.from_hf_dict(config.to_dict()), state


def test_exactly_the_projections_and_the_embedding_are_quantized() -> None:
    arch, state = smollm2_shaped_llama()
    out = dict(quantize_weights(state.items(), "q8_0", arch))
    assert out.keys() == state.keys()
    quantized = {name for name, tensor in out.items() if isinstance(tensor, QuantizedTensor)}
    projections = {
        f"model.layers.{i}.{part}.weight"
        for i in range(arch.num_hidden_layers)
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert quantized == projections | {"model.embed_tokens.weight"}
    for name in state.keys() - quantized:  # the norms, untouched
        assert out[name] is state[name]
    for name in quantized:
        assert out[name].shape == tuple(state[name].shape)


def test_a_bert_encoders_six_projections_are_quantized_and_nothing_else() -> None:
    arch, _ = smollm2_shaped_llama()  # the names decide; the arch only matters for heads
    projections = {
        f"{prefix}encoder.layer.0.{part}.weight"
        for prefix in ("", "bert.")
        for part in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        )
    }
    others = {
        prefix + other
        for prefix in ("", "bert.")
        for other in (
            "encoder.layer.0.attention.self.query.bias",
            "encoder.layer.0.attention.output.LayerNorm.weight",
            "encoder.layer.0.output.LayerNorm.weight",
            "embeddings.word_embeddings.weight",
            "embeddings.position_embeddings.weight",
            "pooler.dense.weight",
        )
    }
    state = {name: torch.randn(64, 64) for name in projections | others}
    out = dict(quantize_weights(state.items(), "q8_0", arch))
    quantized = {name for name, tensor in out.items() if isinstance(tensor, QuantizedTensor)}
    assert quantized == projections
    for name in others:
        assert out[name] is state[name]


def test_an_untied_head_is_quantized_and_a_tied_ones_copy_is_not() -> None:
    arch, _ = smollm2_shaped_llama()
    head = {"lm_head.weight": torch.randn(128, 64)}
    assert torch.is_tensor(dict(quantize_weights(head.items(), "q4_0", arch))["lm_head.weight"])
    untied = ArchConfig.from_hf_dict(tiny_hf_config("llama", 128).to_dict())
    out = dict(quantize_weights(head.items(), "q4_0", untied))["lm_head.weight"]
    assert isinstance(out, QuantizedTensor) and out.qtype == GGMLQuantizationType.Q4_0


def test_gpt2_conv1d_weights_are_quantized_as_out_by_in() -> None:
    config = tiny_hf_config("gpt2", 128)
    torch.manual_seed(0)
    state = transformers.GPT2LMHeadModel(config).state_dict()
    state.pop("lm_head.weight")
    arch = ArchConfig.from_hf_dict(config.to_dict())
    out = dict(quantize_weights(state.items(), "q8_0", arch))
    quantized = {name for name, tensor in out.items() if isinstance(tensor, QuantizedTensor)}
    expected = {"transformer.wte.weight"} | {
        f"transformer.h.{i}.{part}.weight"
        for i in range(arch.num_hidden_layers)
        for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert quantized == expected  # not wpe, the LayerNorms or the biases
    c_fc = out["transformer.h.0.mlp.c_fc.weight"]
    assert isinstance(c_fc, QuantizedTensor)
    stored = state["transformer.h.0.mlp.c_fc.weight"]  # [in 64, out 256]
    assert c_fc.shape == (256, 64)
    assert torch.equal(c_fc.data, quantize_tensor(stored.t(), "q8_0").data)


def test_a_model_quantized_at_load_from_a_folder_runs(tmp_path: object) -> None:
    from pathlib import Path

    from kvserve.attention import get_attention_backend
    from kvserve.models.registry import build_model

    assert isinstance(tmp_path, Path)
    folder = save_tiny_model(tmp_path, "qwen2", train_tiny_tokenizer())  # tied, q/k/v biases
    source = resolve_model(str(folder))
    arch = load_arch_config(source)
    backend = get_attention_backend(
        "torch_paged",
        torch.float32,
        torch.device("cpu"),
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    weights = dict(iter_weights(source, arch, "q4_0"))
    assert isinstance(weights["model.embed_tokens.weight"], QuantizedTensor)
    assert torch.is_tensor(weights["model.layers.0.self_attn.q_proj.bias"])
    model = build_model(arch, 64, torch.float32, backend)
    model.load_weights(weights.items())
    assert model.model.embed_tokens.quantized
    ids = torch.tensor([1, 5, 9])
    table = weights["model.embed_tokens.weight"]
    assert isinstance(table, QuantizedTensor)
    assert torch.equal(model.model.embed_tokens(ids), table.dequantize()[ids])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantization": "q8_0", "device": "cuda"},
        {"quantization": "q4_k", "tensor_parallel_size": 2},
        {"quantization": "q4_1"},
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_quantization(
    kwargs: dict[str, object],
) -> None:
    with pytest.raises(InvalidParameterError) as excinfo:
        EngineConfig.from_kwargs("smollm2-135m-instruct", **kwargs)
    assert excinfo.value.param == "quantization"
    assert "'auto'" in str(excinfo.value) and "'none'" in str(excinfo.value)


def test_quantizing_on_the_cpu_with_one_rank_is_accepted() -> None:
    for quantization in ("auto", "none", "q8_0", "q4_0", "q4_k"):
        config = EngineConfig.from_kwargs(
            "smollm2-135m-instruct", quantization=quantization, device="cpu"
        )
        assert config.model_config.quantization == quantization
    assert ModelConfig(device="cuda", quantization="none").quantization == "none"
