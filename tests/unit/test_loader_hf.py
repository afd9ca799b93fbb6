"""Hugging Face folders: config.json → ArchConfig, safetensors (single or sharded) → weights."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from kvserve.errors import ModelLoadError
from kvserve.loader import ModelSource, iter_weights, load_arch_config, resolve_model

TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def tiny_llama_tied() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        **TINY_SHAPE,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    return transformers.LlamaForCausalLM(config)


def tiny_llama_untied() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(**TINY_SHAPE, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def tiny_qwen2_with_bias() -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(**TINY_SHAPE, tie_word_embeddings=True, eos_token_id=[2, 3])
    return transformers.Qwen2ForCausalLM(config)


def tiny_qwen3_bf16() -> transformers.PreTrainedModel:
    # head_dim 32 ≠ hidden_size / heads = 16: the loader must read it, not derive it.
    config = transformers.Qwen3Config(**TINY_SHAPE, head_dim=32, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config).bfloat16()


MODEL_FACTORIES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "llama-tied": tiny_llama_tied,
    "llama-untied": tiny_llama_untied,
    "qwen2-bias": tiny_qwen2_with_bias,
    "qwen3-bf16": tiny_qwen3_bf16,
}


def expected_state_dict(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        # Tied: lm_head.weight is the embedding, and save_pretrained does not store it.
        state.pop("lm_head.weight")
    return state


@pytest.fixture(scope="module", params=sorted(MODEL_FACTORIES))
def tiny_model(request: pytest.FixtureRequest) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = MODEL_FACTORIES[request.param]()
    # Random, non-trivial values everywhere (norm weights are ones, biases zeros at init).
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_iter_weights_yields_exactly_the_saved_state_dict(
    tiny_model: transformers.PreTrainedModel, sharded: bool, tmp_path: Path
) -> None:
    tiny_model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == sharded

    source = resolve_model(str(tmp_path))
    assert source.kind == "hf"
    weights = iter_weights(source, load_arch_config(source))
    assert isinstance(weights, Iterator)

    expected = expected_state_dict(tiny_model)
    seen: set[str] = set()
    for name, tensor in weights:
        assert name not in seen, f"{name} yielded twice"
        seen.add(name)
        assert name in expected, f"unexpected tensor {name}"
        assert tensor.dtype == expected[name].dtype
        assert torch.equal(tensor, expected[name]), name
    assert seen == set(expected)
    assert ("lm_head.weight" in seen) == (not tiny_model.config.tie_word_embeddings)


def test_arch_config_matches_the_hf_config(
    tiny_model: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    tiny_model.save_pretrained(tmp_path)
    arch = load_arch_config(resolve_model(str(tmp_path)))
    config = tiny_model.config
    assert (
        arch.architecture
        == {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config.model_type]
    )
    assert arch.vocab_size == config.vocab_size
    assert arch.hidden_size == config.hidden_size
    assert arch.intermediate_size == config.intermediate_size
    assert arch.num_hidden_layers == config.num_hidden_layers
    assert arch.num_attention_heads == config.num_attention_heads
    assert arch.num_key_value_heads == config.num_key_value_heads
    expected_head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    assert arch.head_dim == expected_head_dim
    assert arch.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert arch.rope_theta == pytest.approx(config.rope_parameters["rope_theta"])
    assert arch.max_position_embeddings == config.max_position_embeddings
    assert arch.tie_word_embeddings == config.tie_word_embeddings
    assert arch.attention_bias == (config.model_type == "qwen2")
    assert arch.qk_norm == (config.model_type == "qwen3")
    assert arch.rope_scaling is None
    eos = config.eos_token_id
    assert arch.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,) if eos else ())


def test_llama_config_values_are_read_not_defaulted(tmp_path: Path) -> None:
    tiny_llama_tied().save_pretrained(tmp_path)
    arch = load_arch_config(resolve_model(str(tmp_path)))
    assert (arch.rope_theta, arch.rms_norm_eps) == (100000.0, 1e-5)
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))


def test_derived_rotary_buffers_are_not_yielded(tmp_path: Path) -> None:
    tiny_llama_tied().save_pretrained(tmp_path)
    stored = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    save_file(stored, str(tmp_path / "extra.safetensors"))
    source = resolve_model(str(tmp_path))
    names = [name for name, _ in iter_weights(source, load_arch_config(source))]
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in names
    assert "model.embed_tokens.weight" in names


@pytest.mark.parametrize(
    "config_text", ["{not json", '["a", "list"]', '{"model_type": "llama"}', ""]
)
def test_corrupt_config_json_is_a_model_load_error(config_text: str, tmp_path: Path) -> None:
    tiny_llama_tied().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(tmp_path)))
    assert str(excinfo.value).startswith("model: ")


def test_missing_config_json_is_a_model_load_error(tmp_path: Path) -> None:
    source = ModelSource(kind="hf", path=tmp_path, name="tiny")
    with pytest.raises(ModelLoadError):
        load_arch_config(source)


def test_corrupt_safetensors_is_a_model_load_error(tmp_path: Path) -> None:
    tiny_llama_tied().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x07garbage" * 100)
    source = resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError) as excinfo:
        list(iter_weights(source, load_arch_config(source)))
    assert "model.safetensors" in str(excinfo.value)


def test_shard_index_naming_a_missing_shard_is_a_model_load_error(tmp_path: Path) -> None:
    tiny_llama_tied().save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    missing_shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / missing_shard).unlink()
    source = resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError) as excinfo:
        list(iter_weights(source, load_arch_config(source)))
    assert missing_shard in str(excinfo.value)


def sharded_folder(folder: Path) -> dict[str, Any]:
    """Save the tiny tied Llama in shards; returns its parsed index."""
    tiny_llama_tied().save_pretrained(folder, max_shard_size="20KB")
    index: dict[str, Any] = json.loads((folder / "model.safetensors.index.json").read_text())
    return index


def point_first_shard_at(folder: Path, index: dict[str, Any], shard_name: object) -> None:
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {
        tensor: shard_name if shard == first else shard
        for tensor, shard in index["weight_map"].items()
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "escape", ["../outside.safetensors", "{outside}", "sub/../../outside.safetensors"]
)
def test_shard_index_naming_a_path_outside_the_folder_is_refused(
    escape: str, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    index = sharded_folder(folder)
    outside = tmp_path / "outside.safetensors"
    save_file({"model.norm.weight": torch.ones(64)}, str(outside))
    name = escape.format(outside=outside)
    point_first_shard_at(folder, index, name)
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(folder)))
    assert excinfo.value.field == name
    assert "outside the model folder" in str(excinfo.value)


def test_symlinked_shard_that_leaves_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    index = sharded_folder(folder)
    shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "elsewhere.safetensors").write_bytes((folder / shard).read_bytes())
    (folder / shard).unlink()
    (folder / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(folder)))
    assert excinfo.value.field == shard


def test_symlinks_inside_the_folder_and_into_the_hub_cache_blobs_are_followed(
    tmp_path: Path,
) -> None:
    # The Hugging Face cache: snapshots/<rev>/<file> -> ../../blobs/<hash>.
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    saved = tmp_path / "saved"
    tiny_llama_tied().save_pretrained(saved)
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for index, file in enumerate(sorted(saved.iterdir())):
        blob = blobs / f"blob{index}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    source = resolve_model(str(snapshot))
    names = {name for name, _ in iter_weights(source, load_arch_config(source))}
    assert "model.embed_tokens.weight" in names


def test_a_fifo_named_like_weights_is_refused_instead_of_blocking(tmp_path: Path) -> None:
    tiny_llama_tied().save_pretrained(tmp_path)
    os.mkfifo(tmp_path / "extra.safetensors")
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(tmp_path)))
    assert "not a regular file" in str(excinfo.value)


def test_config_json_linked_to_a_device_is_refused(tmp_path: Path) -> None:
    tiny_llama_tied().save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").symlink_to("/dev/zero")
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(ModelSource(kind="hf", path=tmp_path, name="tiny"))
    assert excinfo.value.field == "config.json"


@pytest.mark.parametrize(
    "index_text",
    ['{"weight_map": []}', '{"weight_map": {"a": 3}}', '{"weight_map": {}}', "[]", "{bad json"],
)
def test_malformed_shard_index_is_refused(index_text: str, tmp_path: Path) -> None:
    sharded_folder(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(tmp_path)))
    assert excinfo.value.field == "model.safetensors.index.json"


@pytest.mark.parametrize("shard_name", [{"a": 1}, ["model.safetensors"], None])
def test_shard_index_with_unhashable_or_null_names_is_refused(
    shard_name: object, tmp_path: Path
) -> None:
    index = sharded_folder(tmp_path)
    point_first_shard_at(tmp_path, index, shard_name)
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(tmp_path)))
    assert excinfo.value.field == "model.safetensors.index.json"
