"""A config whose weights could not fit in the model's files is refused before anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import transformers

from gguf_bytes import parts_of, serialize
from gguf_fixtures import TinySpec, write_gguf
from kvserve.errors import ModelLoadError
from kvserve.loader import load_arch_config, resolve_model
from kvserve.loader.model_size import MIN_BITS_PER_WEIGHT

V = gguf.GGUFValueType


def tiny_hf_folder(folder: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_hf_config_describing_more_weights_than_the_files_hold_is_refused(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    # Each value is within its own limit; together they describe 2.2e12 weights.
    config |= {"hidden_size": 65536, "num_hidden_layers": 128, "intermediate_size": 65536}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(folder)))
    assert excinfo.value.field == "num_parameters"
    assert "model.safetensors" in str(excinfo.value)


def test_gguf_metadata_describing_more_weights_than_the_file_holds_is_refused(
    tmp_path: Path,
) -> None:
    base = tmp_path / "base.gguf"
    write_gguf(base, TinySpec(all_f32=True))
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(serialize(parts_of(base).with_value("llama.vocab_size", V.UINT32, 1 << 22)))
    with pytest.raises(ModelLoadError) as excinfo:
        load_arch_config(resolve_model(str(crafted)))
    assert excinfo.value.field == "num_parameters"


def test_real_files_pass_with_a_wide_margin(tmp_path: Path) -> None:
    # float32 safetensors store 32 bits per weight: 32 times the minimum.
    folder = tiny_hf_folder(tmp_path)
    arch = load_arch_config(resolve_model(str(folder)))
    stored_bits = 8 * (folder / "model.safetensors").stat().st_size
    assert stored_bits >= 30 * MIN_BITS_PER_WEIGHT * arch.num_parameters()
