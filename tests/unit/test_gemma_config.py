"""Gemma 2 and Gemma 3 config.json files become the ArchConfig transformers' own reading implies."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from kvserve.errors import ModelLoadError
from kvserve.loader import model_cache
from kvserve.loader.source import ModelSource
from kvserve.models.arch_config import ArchConfig

SMALL: dict[str, Any] = dict(
    vocab_size=80,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=16,
)

# A multimodal Gemma 3 config.json as published: the text part lists only what
# differs from transformers' defaults.
GEMMA3_4B = {
    "model_type": "gemma3",
    "architectures": ["Gemma3ForConditionalGeneration"],
    "eos_token_id": [1, 106],
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}


def test_transformers_5_gemma3_text_config() -> None:
    config = Gemma3TextConfig(**SMALL, query_pre_attn_scalar=12).to_dict()
    arch = ArchConfig.from_hf_dict(config)
    assert arch.architecture == "gemma3" and arch.qk_norm
    # transformers' default pattern: every sixth layer global.
    sliding, full = "sliding_attention", "full_attention"
    assert arch.layer_types == (sliding,) * 5 + (full, sliding)
    assert arch.sliding_window == 16
    assert arch.rope_theta == 1_000_000.0 and arch.rope_local_base_freq == 10_000.0
    assert arch.rope_scaling is None
    assert arch.query_pre_attn_scalar == 12
    assert arch.attn_logit_softcapping is None and arch.final_logit_softcapping is None
    assert arch.tie_word_embeddings and arch.bos_token_id == 2 and arch.eos_token_ids == (1,)
    assert arch.max_position_embeddings == 131072  # the window does not cap the context
    assert arch.layer_sliding_window(0) == 16 and arch.layer_sliding_window(5) is None


def test_older_gemma3_keys_and_the_multimodal_text_config() -> None:
    arch = ArchConfig.from_hf_dict(GEMMA3_4B)
    assert arch.architecture == "gemma3"
    assert (arch.hidden_size, arch.num_hidden_layers, arch.sliding_window) == (2560, 34, 1024)
    # transformers' defaults fill what the file leaves out.
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (8, 4, 256)
    assert arch.vocab_size == 262208 and arch.query_pre_attn_scalar == 256
    assert arch.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert arch.rope_theta == 1_000_000.0 and arch.rope_local_base_freq == 10_000.0
    assert arch.eos_token_ids == (1, 106)  # from the top level
    assert arch.layer_types is not None and arch.layer_types.count("full_attention") == 5


def test_gemma3_rope_parameters_per_layer_type() -> None:
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 123.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 4567.0},
    }
    arch = ArchConfig.from_hf_dict(Gemma3TextConfig(**SMALL, rope_parameters=rope).to_dict())
    assert arch.rope_theta == 4567.0 and arch.rope_local_base_freq == 123.0
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "linear"
    local_yarn = {**rope, "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(ModelLoadError, match="sliding_attention"):
        ArchConfig.from_hf_dict(
            {**Gemma3TextConfig(**SMALL).to_dict(), "rope_parameters": local_yarn}
        )


def test_gemma2_config_keeps_its_soft_caps_and_alternating_layers() -> None:
    arch = ArchConfig.from_hf_dict(Gemma2Config(**SMALL).to_dict())
    assert arch.architecture == "gemma2" and not arch.qk_norm
    assert arch.attn_logit_softcapping == 50.0 and arch.final_logit_softcapping == 30.0
    assert arch.layer_types == ("sliding_attention", "full_attention") * 3 + ("sliding_attention",)
    assert arch.rope_local_base_freq is None and arch.rope_theta == 10000.0
    off = ArchConfig.from_hf_dict(
        {**Gemma2Config(**SMALL).to_dict(), "final_logit_softcapping": None}
    )
    assert off.final_logit_softcapping is None  # an explicit null turns a cap off


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),  # 7 layers
        ({"layer_types": ["local"] * 7}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),  # sliding layers, no window
        ({"sliding_window": 0}, "sliding_window"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ({"rope_parameters": "fast"}, "rope_parameters"),
        ({"sliding_window_pattern": 0, "layer_types": None}, "sliding_window_pattern"),
    ],
)
def test_bad_gemma_values_are_refused_naming_the_key(change: dict[str, Any], field: str) -> None:
    config = {**Gemma3TextConfig(**SMALL).to_dict(), **change}
    with pytest.raises(ModelLoadError) as excinfo:
        ArchConfig.from_hf_dict(config)
    assert excinfo.value.field == field


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_num_parameters_counts_what_transformers_builds(family: str) -> None:
    config = Gemma2Config(**SMALL) if family == "gemma2" else Gemma3TextConfig(**SMALL)
    model_class = Gemma2ForCausalLM if family == "gemma2" else Gemma3ForCausalLM
    with torch.device("meta"):
        model = model_class(config)
    arch = ArchConfig.from_hf_dict(config.to_dict())
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())


def test_the_model_cache_gives_back_the_same_gemma_config(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch = ArchConfig.from_hf_dict(Gemma3TextConfig(**SMALL).to_dict())
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "1")
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_DIR", raising=False)
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"not read: the build function stands in for the GGUF reader")
    source = ModelSource(kind="gguf", path=model_file, name="m")
    assert model_cache.cached_arch_config(source, lambda: arch) == arch
    entry = model_cache.model_cache_entry(source)
    assert entry is not None
    stored = json.loads(entry.arch_path.read_text())["arch"]
    assert stored["layer_types"] == list(arch.layer_types or ())
    again = model_cache.cached_arch_config(source, lambda: pytest.fail("not read from the cache"))
    assert again == arch and dataclasses.asdict(again) == dataclasses.asdict(arch)
