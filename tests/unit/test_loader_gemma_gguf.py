"""Gemma 2 and Gemma 3 GGUF files load into exactly the model their Hugging Face folder does.

A tiny random Gemma checkpoint is saved by transformers, then written as a
GGUF the way llama.cpp's converter writes one: GGUF tensor names, the norms
stored as ``1 + w``, F32 tensors (so nothing is lost), the window, soft caps,
layer pattern and local RoPE base as ``gemma2.*``/``gemma3.*`` metadata.
Both files must give the same shape and bit-identical parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from gguf_fixtures import HF_TO_GGUF_GLOBAL, HF_TO_GGUF_LAYER
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.errors import ModelLoadError
from kvserve.loader import iter_weights, load_arch_config, resolve_model
from kvserve.loader.gguf_config import load_gguf_arch_config
from kvserve.models.registry import build_model

# Gemma's GGUF names: Llama's, except for its four norms (ffn_norm is the one before the MLP).
LAYER_NAMES = {
    **HF_TO_GGUF_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GLOBAL_NAMES = {k: v for k, v in HF_TO_GGUF_GLOBAL.items() if k != "lm_head.weight"}  # tied
GEMMA3_LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
]
COMMON: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    query_pre_attn_scalar=16,  # llama.cpp scales queries by head_dim (but for the 27B models)
    sliding_window=8,
    max_position_embeddings=256,
)


def tiny_config(family: str) -> Any:
    if family == "gemma2":
        return Gemma2Config(**COMMON, attn_logit_softcapping=7.0, final_logit_softcapping=9.0)
    return Gemma3TextConfig(
        **COMMON,
        layer_types=GEMMA3_LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
        },
    )


def save_checkpoint(folder: Path, family: str) -> None:
    torch.manual_seed(0)
    model_class = Gemma2ForCausalLM if family == "gemma2" else Gemma3ForCausalLM
    model = model_class(tiny_config(family))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(folder)


def write_gguf(path: Path, folder: Path, family: str) -> None:
    """The checkpoint in ``folder`` as llama.cpp's converter writes it."""
    config = tiny_config(family)
    writer = gguf.GGUFWriter(path, family)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_float32("gemma2.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", config.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_float32("gemma3.rope.freq_base_swa", 500.0)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)
        writer.add_array(
            "gemma3.attention.sliding_window_pattern",
            [layer_type == "sliding_attention" for layer_type in GEMMA3_LAYER_TYPES],
        )
    writer.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    for name, array in load_file(folder / "model.safetensors").items():
        if name == "lm_head.weight":
            continue  # tied
        if name in GLOBAL_NAMES:
            gguf_name = GLOBAL_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"
        stored = array.astype(np.float32)
        if name.endswith("norm.weight"):
            stored = stored + np.float32(1.0)  # the converter's norm shift
        writer.add_tensor(gguf_name, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def loaded_state(model: str) -> tuple[Any, dict[str, torch.Tensor]]:
    source = resolve_model(model)
    arch = load_arch_config(source)
    built = build_model(arch, 256, torch.float32, TorchPagedAttention())
    built.load_weights(iter_weights(source, arch))
    return arch, built.state_dict()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gguf_and_hugging_face_folder_load_identical_models(tmp_path: Path, family: str) -> None:
    folder = tmp_path / "hf"
    save_checkpoint(folder, family)
    write_gguf(tmp_path / "tiny.gguf", folder, family)
    hf_arch, hf_state = loaded_state(str(folder))
    gguf_arch, gguf_state = loaded_state(str(tmp_path / "tiny.gguf"))
    for field in (
        "architecture",
        "head_dim",
        "rope_theta",
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_local_base_freq",
        "qk_norm",
        "tie_word_embeddings",
    ):
        assert getattr(gguf_arch, field) == getattr(hf_arch, field), field
    assert (gguf_arch.rope_scaling is None) == (family == "gemma2")
    assert hf_state.keys() == gguf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(tensor, gguf_state[name]), name
    # The norms hold 1 + w: transformers' zero-initialised Gemma norm is the identity.
    norm = hf_state["model.layers.0.input_layernorm.weight"]
    stored = load_file(folder / "model.safetensors")["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.from_numpy(stored) + 1.0)


def metadata_only_copy(path: Path, target: Path, drop: str, **replace: Any) -> Path:
    """``path``'s metadata without the keys ending in ``drop``, ``replace``'s keys set anew."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")) or key.endswith(drop):
            continue
        value = replace.get(key, field.contents())
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, field.types[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return target


def test_gemma3_default_layer_pattern_is_five_sliding_then_one_global(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    save_checkpoint(folder, "gemma3")
    write_gguf(tmp_path / "tiny.gguf", folder, "gemma3")
    # Without the pattern key, llama.cpp's fixed pattern for gemma3 applies.
    path = metadata_only_copy(
        tmp_path / "tiny.gguf",
        tmp_path / "default.gguf",
        "window_pattern",
        **{"gemma3.block_count": 12},
    )
    arch = load_gguf_arch_config(path)
    assert arch.layer_types == tuple((["sliding_attention"] * 5 + ["full_attention"]) * 2)
    assert arch.rope_local_base_freq == 500.0


def test_gemma_gguf_without_a_sliding_window_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    save_checkpoint(folder, "gemma2")
    write_gguf(tmp_path / "tiny.gguf", folder, "gemma2")
    path = metadata_only_copy(tmp_path / "tiny.gguf", tmp_path / "bad.gguf", "sliding_window")
    with pytest.raises(ModelLoadError, match=r"gemma2\.attention\.sliding_window is missing"):
        load_gguf_arch_config(path)
