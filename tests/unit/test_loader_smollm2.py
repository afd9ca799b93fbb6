"""The real SmolLM2-135M-Instruct GGUF: config, weights checked against transformers, tokenizer.

transformers' own GGUF loader is the reference for the weights: it dequantizes
with the same gguf-py code and undoes llama.cpp's q/k permutation its own way,
so equal tensors prove our names, layout and permutation.
"""

from __future__ import annotations

import gc
import socket
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kvserve.errors import ModelLoadError
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.loader import (
    ModelSource,
    gguf_weights,
    iter_weights,
    load_arch_config,
    load_tokenizer,
    resolve_model,
)
from kvserve.loader.gguf_file import find_tensor, open_gguf
from kvserve.loader.gguf_weights import iter_gguf_weights
from kvserve.models.arch_config import ArchConfig
from proc_maps import linux_only, resident_file_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    try:
        return resolve_model("smollm2-135m-instruct")
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")


@pytest.fixture(scope="module")
def smollm2_arch(smollm2: ModelSource) -> ArchConfig:
    return load_arch_config(smollm2)


@pytest.fixture(scope="module")
def reference_weights(smollm2: ModelSource) -> dict[str, torch.Tensor]:
    """All weights as transformers loads them from the GGUF (float32, HF names)."""
    # AutoModelForCausalLM.from_pretrained(..., gguf_file=...) needs the
    # `accelerate` package, which kvserve does not depend on; this is the
    # function it calls to read the tensors. The weightless (meta) model only
    # supplies the HF parameter names, so its config is written out here
    # rather than parsed from the file a second time.
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    parsed = load_gguf_checkpoint(
        smollm2.path, return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    return dict(parsed["tensors"])


@pytest.fixture(scope="module")
def tokenizer(smollm2: ModelSource) -> PreTrainedTokenizerBase:
    with pytest.MonkeyPatch.context() as patch:
        # Loading must stay offline: any connection attempt fails the test.
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("load_tokenizer tried to use the network")

        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket, "getaddrinfo", refuse)
        return load_tokenizer(smollm2)


def test_arch_config_of_smollm2(smollm2_arch: ArchConfig) -> None:
    arch = smollm2_arch
    assert arch.architecture == "llama"
    assert arch.num_hidden_layers == 30
    assert arch.hidden_size == 576
    assert arch.intermediate_size == 1536
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert arch.vocab_size == 49152
    assert arch.tie_word_embeddings
    assert not arch.attention_bias
    assert not arch.qk_norm
    assert arch.rope_theta == 100000.0
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.max_position_embeddings == 8192
    assert arch.rope_scaling is None
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))


def test_weights_equal_what_transformers_loads(
    smollm2: ModelSource,
    smollm2_arch: ArchConfig,
    reference_weights: dict[str, torch.Tensor],
) -> None:
    names = []
    for name, tensor in iter_weights(smollm2, smollm2_arch):
        names.append(name)
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, reference_weights[name], rtol=0, atol=0, msg=name)
    assert sorted(names) == sorted(reference_weights)
    assert "lm_head.weight" not in names


def test_q_proj_rows_differ_from_the_stored_order(
    smollm2: ModelSource,
    smollm2_arch: ArchConfig,
    reference_weights: dict[str, torch.Tensor],
) -> None:
    # Guards the test above: if the file's row order equalled HF's, equal
    # weights would prove nothing about the permutation.
    stored = find_tensor(open_gguf(smollm2.path), "blk.0.attn_q.weight")
    assert stored is not None
    stored_q = gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(576, 576)
    assert not torch.equal(
        torch.from_numpy(stored_q), reference_weights["model.layers.0.self_attn.q_proj.weight"]
    )


@linux_only
def test_reordered_q_k_rows_leave_no_file_pages_resident(
    smollm2: ModelSource, smollm2_arch: ArchConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Kept quantized, the other matrices are views nobody reads here; the q/k
    # projections are read to reorder their rows, and those copies replace them.
    # The reference is the same load with the file's pages left alone.
    path = smollm2.path.resolve()
    qk_bytes = sum(
        int(t.n_bytes)
        for t in open_gguf(path).tensors
        if t.name.endswith(("attn_q.weight", "attn_k.weight"))
    )

    loads: list[dict[str, torch.Tensor | QuantizedTensor]] = []  # their mappings stay

    def resident_growth() -> int:
        gc.collect()  # unmaps the files of readers no longer used
        before = resident_file_bytes(path)
        loads.append(dict(iter_gguf_weights(path, smollm2_arch, keep_quantized=True)))
        q_proj = loads[-1]["model.layers.0.self_attn.q_proj.weight"]
        assert isinstance(q_proj, QuantizedTensor) and q_proj.rows == 576
        return resident_file_bytes(path) - before

    with monkeypatch.context() as patch:
        patch.setattr(gguf_weights, "drop_file_pages", lambda data: None)
        kept = resident_growth()
    dropped = resident_growth()
    assert kept - dropped >= 0.9 * qk_bytes


def test_tokenizer_round_trips_text(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Hello world! Paged attention, café, ünïcode, 12345 and    spaces."
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) > 5
    assert tokenizer.decode(token_ids) == text
    assert len(tokenizer) == 49152


def test_tokenizer_chat_template_is_chatml(
    tokenizer: PreTrainedTokenizerBase, smollm2_arch: ArchConfig
) -> None:
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in smollm2_arch.eos_token_ids


def test_tokenizer_saved_as_hf_folder_loads_the_same(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(ModelSource(kind="hf", path=tmp_path, name=str(tmp_path)))
    text = "The quick brown fox, 42 times."
    assert reloaded.encode(text) == tokenizer.encode(text)
    assert reloaded.chat_template == tokenizer.chat_template


def test_truncated_gguf_is_a_model_load_error(smollm2: ModelSource, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with smollm2.path.open("rb") as original:
        truncated.write_bytes(original.read(1 << 20))
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(truncated)))
    assert isinstance(excinfo.value, ValueError)
    assert str(excinfo.value).startswith("model: ")
    assert "truncated.gguf" in str(excinfo.value)


def test_gguf_cut_inside_the_tensor_data_is_a_model_load_error(
    smollm2: ModelSource, tmp_path: Path
) -> None:
    # Header intact, last tensors missing: the reader must notice, not mmap past the end.
    truncated = tmp_path / "cut.gguf"
    with smollm2.path.open("rb") as original:
        truncated.write_bytes(original.read(smollm2.path.stat().st_size - 4096))
    with pytest.raises(ModelLoadError):
        load_arch_config(resolve_model(str(truncated)))
