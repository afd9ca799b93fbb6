"""The worker's CPU fast path takes the models it can run and leaves the others alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine import LLMEngine
from kvserve.kernels import native_ops
from kvserve.kernels.weight_kind import WeightKind
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.weight_format import KernelBF16Weights, KernelF32Weights, TorchWeights
from kvserve.models.decoder_model import DecoderLayer, DecoderModel, HasDecoder
from kvserve.worker.cpu_weights import store_linear_weights_in_bf16, use_linear_kernels
from kvserve.worker.decode_layouts import read_decode_layer
from kvserve.worker.native_decode import NativeDecoder
from model_fixtures import TINY_KINDS, save_tiny_model, train_tiny_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if native_ops() is None:
        pytest.skip("the C kernels could not be built here")
    tokenizer = train_tiny_tokenizer()
    return {
        kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer)
        for kind in ("llama", "qwen2", "qwen3", "gpt2")
    }


def engine(folder: Path, **kwargs: object) -> LLMEngine:
    return LLMEngine.from_engine_args(str(folder), num_blocks=32, block_size=4, **kwargs)


@pytest.mark.parametrize(
    ("kind", "dtype"), [("llama", "float32"), ("qwen2", "bfloat16"), ("qwen3", "float32")]
)
def test_llama_shaped_layers_get_the_one_call_decoder(
    folders: dict[str, Path], kind: str, dtype: str
) -> None:
    llm_engine = engine(folders[kind], dtype=dtype)
    runner = llm_engine.runner
    decoder = runner.native_decoder
    assert decoder is not None
    assert len(decoder.stack.layers) == llm_engine.arch.num_hidden_layers
    assert decoder.stack.kv_bf16 == (dtype == "bfloat16")
    kind = decoder.ops.weight_kind(getattr(torch, dtype))
    assert all(list(layer.weight_kinds) == [kind] * 4 for layer in decoder.stack.layers)
    # Every shared layer took the kernels; the model file declares none of them.
    for module in runner.model.modules():
        if isinstance(module, Linear):
            assert isinstance(module.format, KernelF32Weights | KernelBF16Weights)
        if isinstance(module, RMSNorm):
            assert module.native is not None


def test_layers_the_kernel_cannot_walk_keep_the_per_layer_path(
    folders: dict[str, Path],
) -> None:
    llama = engine(folders["llama"]).runner
    layer = llama.model.model.layers[0]
    assert read_decode_layer(layer) is not None
    layer.extra = torch.nn.Linear(2, 2)  # a weighted part no family's layout names
    assert read_decode_layer(layer) is None
    pytorch_attention = engine(folders["llama"], attention_backend="torch_paged").runner
    assert pytorch_attention.native_decoder is None
    assert NativeDecoder.for_model(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt2_layers_get_the_one_call_decoder_and_the_per_op_kernels(
    folders: dict[str, Path], dtype: str
) -> None:
    # LayerNorm with biases, a plain GELU MLP, biases on every projection, no RoPE.
    runner = engine(folders["gpt2"], dtype=dtype).runner
    decoder = runner.native_decoder
    assert decoder is not None
    assert len(decoder.stack.layers) == runner.model.arch.num_hidden_layers
    assert decoder.rope_tables(torch.arange(3)) == []
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * runner.model.arch.num_hidden_layers + 1  # + the LM head
    for linear in linears:
        assert isinstance(linear.format, KernelF32Weights | KernelBF16Weights)
        assert linear.weight.dtype == getattr(torch, dtype)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_every_family_declares_its_decoder_and_layers_to_the_fast_path(
    tmp_path: Path, kind: str
) -> None:
    # The worker walks a model only through the interface its classes declare.
    if native_ops() is None:
        pytest.skip("the C kernels could not be built here")
    runner = engine(save_tiny_model(tmp_path, kind, train_tiny_tokenizer())).runner
    assert isinstance(runner.model, HasDecoder)
    decoder = runner.model.decoder()
    assert isinstance(decoder, DecoderModel)
    layers = decoder.decoder_layers()
    assert len(layers) == runner.model.arch.num_hidden_layers
    assert all(isinstance(layer, DecoderLayer) for layer in layers)
    assert runner.native_decoder is not None


def test_each_linear_of_a_layer_is_multiplied_as_its_own_format_says(
    folders: dict[str, Path],
) -> None:
    # One projection in bf16 among float32 ones: the stack reads a kind per linear,
    # and computes what the per-layer path computes on the same weights.
    llm = LLM(str(folders["llama"]), dtype="float32", num_blocks=32, block_size=4)
    runner = llm.llm_engine.runner
    ops = native_ops()
    assert ops is not None
    o_proj = runner.model.model.layers[1].self_attn.o_proj
    o_proj.format = TorchWeights()
    store_linear_weights_in_bf16(o_proj)
    use_linear_kernels(o_proj, ops)
    assert isinstance(o_proj.format, KernelBF16Weights)
    decoder = NativeDecoder.for_model(runner.model, ops)
    assert decoder is not None
    kinds = [list(layer.weight_kinds) for layer in decoder.stack.layers]
    assert kinds[0] == [WeightKind.F32] * 4
    assert kinds[1] == [WeightKind.F32, ops.weight_kind(torch.bfloat16), *[WeightKind.F32] * 2]
    runner.fast_path = decoder
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    fast = llm.generate(prompts, params, use_tqdm=False)
    runner.fast_path = None
    per_layer = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, per_layer, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(
            a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True
        ):
            for token, logprob in step_a.items():
                assert abs(logprob.logprob - step_b[token].logprob) < 1e-4
