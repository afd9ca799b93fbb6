"""The worker's CPU fast path takes the models it can run and leaves the others alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine import LLMEngine
from kvserve.kernels import native_ops
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.worker.native_decode import NativeDecoder, read_decode_layer
from model_fixtures import save_tiny_model, train_tiny_tokenizer


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


@pytest.mark.parametrize(("kind", "dtype"), [("llama", "float32"), ("qwen2", "bfloat16")])
def test_llama_shaped_layers_get_the_one_call_decoder(
    folders: dict[str, Path], kind: str, dtype: str
) -> None:
    llm_engine = engine(folders[kind], dtype=dtype)
    runner = llm_engine.runner
    decoder = runner.native_decoder
    assert decoder is not None
    assert len(decoder.stack.layers) == llm_engine.arch.num_hidden_layers
    assert decoder.stack.kv_bf16 == (dtype == "bfloat16")
    assert decoder.stack.shape.weight_dtype == getattr(torch, dtype)
    # Every shared layer took the kernels; the model file declares none of them.
    for module in runner.model.modules():
        if isinstance(module, Linear | RMSNorm):
            assert module.native is not None


def test_layers_the_kernel_cannot_walk_keep_the_per_layer_path(
    folders: dict[str, Path],
) -> None:
    qwen3 = engine(folders["qwen3"]).runner  # q/k norms
    assert qwen3.native_decoder is None
    assert read_decode_layer(qwen3.model.model.layers[0]) is None
    pytorch_attention = engine(folders["llama"], attention_backend="torch_paged").runner
    assert pytorch_attention.native_decoder is None
    assert NativeDecoder.for_model(torch.nn.Linear(2, 2)) is None


def test_gpt2_takes_the_per_op_kernels_but_not_the_llama_stack(folders: dict[str, Path]) -> None:
    runner = engine(folders["gpt2"], dtype="bfloat16").runner
    assert runner.native_decoder is None  # LayerNorm, GELU, learned positions
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * runner.model.arch.num_hidden_layers + 1  # + the LM head
    assert all(m.native is not None and m.weight.dtype == torch.bfloat16 for m in linears)
