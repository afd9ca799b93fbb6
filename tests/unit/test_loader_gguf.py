"""GGUF files written with gguf.GGUFWriter (see gguf_fixtures): metadata → ArchConfig, tensors → HF weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gguf_bytes import parts_of, serialize
from gguf_fixtures import (
    MATRIX_TYPES,
    TinySpec,
    llama_cpp_permute,
    llama_cpp_rope_factors,
    with_tiny_tokenizer,
    write_gguf,
)
from kvserve.errors import ModelLoadError
from kvserve.loader import (
    ModelSource,
    iter_weights,
    load_arch_config,
    load_tokenizer,
    resolve_model,
)
from model_fixtures import tiny_arch_config

Q = gguf.GGMLQuantizationType

# Bound on ||dequantized - original|| / ||original|| for Gaussian weights; the
# measured values stay below 3/4 of these. A row mix-up gives about 1.4.
RELATIVE_ERROR_BOUND = {
    Q.F32: 0.0,
    Q.F16: 5e-4,
    Q.BF16: 4e-3,
    Q.Q8_0: 1e-2,
    Q.Q5_1: 0.06,
    Q.Q5_0: 0.06,
    Q.Q4_1: 0.12,
    Q.Q4_0: 0.13,
}


def load(tmp_path: Path, spec: TinySpec) -> tuple[ModelSource, dict[str, np.ndarray], dict[str, Q]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"tiny-{spec.arch}.gguf"
    weights, types = write_gguf(path, spec)
    return resolve_model(str(path)), weights, types


ARCH_SPECS = {
    "llama": TinySpec(arch="llama"),
    "qwen2": TinySpec(arch="qwen2", tied=False),
    # head_dim 32 ≠ hidden / heads = 16, as in real Qwen3 models.
    "qwen3": TinySpec(arch="qwen3", head_dim=32),
}


@pytest.mark.parametrize("arch", sorted(ARCH_SPECS))
def test_arch_config_comes_from_gguf_metadata(arch: str, tmp_path: Path) -> None:
    spec = ARCH_SPECS[arch]
    source, _, _ = load(tmp_path, spec)
    config = load_arch_config(source)
    assert config.architecture == arch
    assert config.vocab_size == spec.vocab
    assert config.hidden_size == spec.hidden
    assert config.intermediate_size == spec.ffn
    assert config.num_hidden_layers == spec.layers
    assert config.num_attention_heads == spec.heads
    assert config.num_key_value_heads == spec.kv_heads
    assert config.head_dim == spec.head_dim
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.rope_theta == spec.rope_theta
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings == spec.tied
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize("arch", sorted(ARCH_SPECS))
def test_weights_round_trip_within_quantization_error(arch: str, tmp_path: Path) -> None:
    source, weights, types = load(tmp_path, ARCH_SPECS[arch])
    loaded = dict(iter_weights(source, load_arch_config(source)))
    assert set(loaded) == set(weights)
    assert set(types.values()) >= set(MATRIX_TYPES)
    for name, original in weights.items():
        tensor = loaded[name]
        assert tensor.dtype == torch.float32
        assert tuple(tensor.shape) == original.shape, name
        # Quantization works on blocks within a row, so moving whole rows (the
        # q/k permutation) commutes with it: the loader must return exactly
        # the dequantized original.
        exact = gguf.quants.dequantize(gguf.quants.quantize(original, types[name]), types[name])
        assert torch.equal(tensor, torch.from_numpy(exact.reshape(original.shape))), name
        relative_error = np.linalg.norm(tensor.numpy() - original) / np.linalg.norm(original)
        assert relative_error <= RELATIVE_ERROR_BOUND[types[name]], (name, types[name].name)


def test_llama_q_and_k_permutation_is_undone_exactly(tmp_path: Path) -> None:
    spec = TinySpec(arch="llama", all_f32=True, heads=4, kv_heads=2)
    source, weights, _ = load(tmp_path, spec)
    loaded = dict(iter_weights(source, load_arch_config(source)))
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        assert torch.equal(loaded[name], torch.from_numpy(weights[name]))
        # The file really holds other rows there, so the check above means something.
        heads = spec.heads if "q_proj" in name else spec.kv_heads
        assert not np.array_equal(llama_cpp_permute(weights[name], heads), weights[name])


def test_untied_model_yields_lm_head_and_tied_does_not(tmp_path: Path) -> None:
    for tied in (True, False):
        source, weights, _ = load(tmp_path, TinySpec(tied=tied, all_f32=True))
        names = [name for name, _ in iter_weights(source, load_arch_config(source))]
        assert ("lm_head.weight" in names) == (not tied)
        if not tied:
            lm_head = dict(iter_weights(source, load_arch_config(source)))["lm_head.weight"]
            assert torch.equal(lm_head, torch.from_numpy(weights["lm_head.weight"]))


def test_vocab_size_falls_back_to_token_list_and_eot_ends_generation(tmp_path: Path) -> None:
    spec = TinySpec(write_vocab_size=False, extra_metadata=lambda w: w.add_eot_token_id(7))
    source, _, _ = load(tmp_path, spec)
    config = load_arch_config(source)
    assert config.vocab_size == spec.vocab
    assert config.eos_token_ids == (2, 7)


def test_linear_and_yarn_rope_scaling_metadata(tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)

    source, _, _ = load(tmp_path / "linear", TinySpec(extra_metadata=linear))
    assert load_arch_config(source).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    source, _, _ = load(tmp_path / "yarn", TinySpec(extra_metadata=yarn))
    assert load_arch_config(source).rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }


def test_unsupported_rope_scaling_type_is_a_model_load_error(tmp_path: Path) -> None:
    def longrope(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        writer.add_rope_scaling_factor(4.0)

    source, _, _ = load(tmp_path, TinySpec(extra_metadata=longrope))
    with pytest.raises(ModelLoadError, match="longrope"):
        load_arch_config(source)


def test_llama3_rope_freqs_tensor_becomes_equivalent_rope_scaling(tmp_path: Path) -> None:
    llama3 = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    theta, head_dim = 500000.0, 64
    factors = llama_cpp_rope_factors(head_dim, theta, llama3)
    spec = TinySpec(
        hidden=128,
        heads=2,
        kv_heads=1,
        head_dim=head_dim,
        rope_theta=theta,
        extra_tensors={"rope_freqs.weight": (factors, Q.F32)},
    )
    source, weights, _ = load(tmp_path, spec)
    config = load_arch_config(source)
    assert config.rope_scaling is not None
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["factor"] == 32.0
    # With Llama 3's 8192-token original context the published parameters come back.
    assert config.rope_scaling["original_max_position_embeddings"] == 8192
    assert config.rope_scaling["low_freq_factor"] == pytest.approx(1.0, rel=1e-3)
    assert config.rope_scaling["high_freq_factor"] == pytest.approx(4.0, rel=1e-3)
    # Only the frequencies are recoverable, not each parameter: compare what
    # transformers computes from our dict with what llama.cpp computes.
    hf_config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={**config.rope_scaling, "rope_theta": config.rope_theta},
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    base_inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    torch.testing.assert_close(
        inv_freq.double(), torch.from_numpy(base_inv_freq / factors), rtol=1e-5, atol=0
    )
    # The factors live in the config now, not among the weights.
    assert set(dict(iter_weights(source, config))) == set(weights)


def test_rope_freqs_that_are_not_llama3_are_a_model_load_error(tmp_path: Path) -> None:
    factors = np.linspace(1.0, 8.0, 8, dtype=np.float32)[::-1].copy()
    spec = TinySpec(extra_tensors={"rope_freqs.weight": (factors, Q.F32)})
    source, _, _ = load(tmp_path, spec)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_arch_config(source)


def test_unsupported_architecture_is_a_model_load_error(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_arch_config(resolve_model(str(path)))


def test_missing_required_metadata_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "no-blocks.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_context_length(512)
    writer.add_vocab_size(10)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_feed_forward_length(128)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"llama\.block_count"):
        load_arch_config(resolve_model(str(path)))


def test_unknown_tensor_name_is_a_model_load_error(tmp_path: Path) -> None:
    spec = TinySpec(
        all_f32=True,
        extra_tensors={"blk.0.attn_mystery.weight": (np.ones(64, np.float32), Q.F32)},
    )
    source, _, _ = load(tmp_path, spec)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_mystery\.weight"):
        list(iter_weights(source, load_arch_config(source)))


def test_tensor_type_that_cannot_be_dequantized_is_a_model_load_error(tmp_path: Path) -> None:
    # Q8_1 blocks: 32 values in 40 bytes; gguf-py has no dequantizer for it.
    raw = np.random.default_rng(0).integers(0, 255, size=(64, 2 * 40), dtype=np.uint8)
    spec = TinySpec(all_f32=True, extra_tensors={"output.weight": (raw, Q.Q8_1)})
    source, _, _ = load(tmp_path, spec)
    with pytest.raises(ModelLoadError) as excinfo:
        list(iter_weights(source, load_arch_config(source)))
    assert "output.weight" in str(excinfo.value)
    assert "Q8_1" in str(excinfo.value)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 50])
def test_garbage_named_gguf_is_a_model_load_error(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    source = resolve_model(str(path))
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(source)
    assert str(excinfo.value).startswith("model: ")
    some_config = tiny_arch_config()
    with pytest.raises(ModelLoadError):
        list(iter_weights(source, some_config))


V = gguf.GGUFValueType


@pytest.mark.parametrize(
    ("key", "value_type", "value", "item_type", "field"),
    [
        ("llama.attention.head_count", V.UINT32, 0, None, "llama.attention.head_count"),
        ("llama.attention.head_count", V.INT32, -4, None, "llama.attention.head_count"),
        ("llama.attention.head_count", V.STRING, "4", None, "llama.attention.head_count"),
        ("llama.attention.head_count", V.FLOAT32, 4.0, None, "llama.attention.head_count"),
        ("llama.attention.head_count", V.ARRAY, [4] * 2000, V.UINT32, "llama.attention.head_count"),
        ("llama.attention.head_count", V.ARRAY, [4, 2], V.UINT32, "llama.attention.head_count"),
        ("llama.attention.head_count", V.ARRAY, [], V.UINT32, "llama.attention.head_count"),
        ("llama.attention.head_count", V.UINT32, 3, None, "llama.embedding_length"),
        ("llama.attention.head_count_kv", V.UINT32, 3, None, "num_key_value_heads"),
        ("llama.attention.key_length", V.UINT32, 32, None, "llama.rope.dimension_count"),
        ("llama.attention.value_length", V.UINT32, 8, None, "llama.attention.value_length"),
        ("llama.attention.key_length", V.UINT64, 2**40, None, "llama.attention.key_length"),
        ("llama.context_length", V.UINT64, 2**40, None, "llama.context_length"),
        ("llama.block_count", V.UINT32, 2**20, None, "llama.block_count"),
        ("llama.embedding_length", V.UINT64, 2**33, None, "llama.embedding_length"),
        ("llama.feed_forward_length", V.INT64, -1, None, "llama.feed_forward_length"),
        ("llama.vocab_size", V.UINT64, 2**30, None, "llama.vocab_size"),
        ("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, 0.0, None, None),
        ("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, float("nan"), None, None),
        ("llama.rope.freq_base", V.FLOAT32, float("-inf"), None, "llama.rope.freq_base"),
        ("llama.rope.scaling.type", V.STRING, "linear", None, "llama.rope.scaling.factor"),
        ("tokenizer.ggml.bos_token_id", V.STRING, "1", None, "tokenizer.ggml.bos_token_id"),
        ("tokenizer.ggml.eos_token_id", V.FLOAT64, 2.0, None, "tokenizer.ggml.eos_token_id"),
        ("general.architecture", V.UINT32, 7, None, "general.architecture"),
    ],
)
def test_metadata_out_of_range_or_of_the_wrong_type_is_refused_naming_the_key(
    tmp_path: Path,
    key: str,
    value_type: int,
    value: object,
    item_type: int | None,
    field: str | None,
) -> None:
    base = tmp_path / "base.gguf"
    write_gguf(base, TinySpec(all_f32=True))
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(serialize(parts_of(base).with_value(key, value_type, value, item_type)))
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(crafted)))
    assert excinfo.value.field == (field or key)
    assert str(excinfo.value).startswith("model: ")


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -2.0, 0.5])
def test_rope_freqs_that_divide_by_zero_or_are_not_finite_are_refused(
    bad: float, tmp_path: Path
) -> None:
    factors = np.linspace(1.0, 8.0, 8, dtype=np.float32)
    factors[3] = bad
    source, _, _ = load(tmp_path, TinySpec(extra_tensors={"rope_freqs.weight": (factors, Q.F32)}))
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(source)
    assert excinfo.value.field == "rope_freqs.weight"


def test_a_tokenizer_transformers_cannot_build_is_a_model_load_error(tmp_path: Path) -> None:
    base = tmp_path / "base.gguf"
    write_gguf(base, with_tiny_tokenizer(TinySpec()))
    crafted = tmp_path / "crafted.gguf"
    # An end-of-sequence id past the vocabulary: transformers' GGUF conversion
    # raises IndexError, which must reach the caller as ModelLoadError.
    parts = parts_of(base).with_value("tokenizer.ggml.eos_token_id", V.UINT32, 10**6)
    crafted.write_bytes(serialize(parts))
    source = resolve_model(str(crafted))
    with pytest.raises(ModelLoadError) as excinfo:
        load_tokenizer(source)
    assert excinfo.value.field == "tokenizer"
    assert "IndexError" in str(excinfo.value)
