"""ArchConfig reads Hugging Face configs of the supported families."""

from __future__ import annotations

import pytest

from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig

MISTRAL = {
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "eos_token_id": 2,
}


def test_sliding_window_caps_the_context_so_full_attention_stays_exact() -> None:
    arch = ArchConfig.from_hf_dict(MISTRAL)
    assert arch.architecture == "llama"
    assert arch.max_position_embeddings == 4096
    assert arch.head_dim == 128
    assert arch.eos_token_ids == (2,)


def test_no_sliding_window_keeps_the_full_context() -> None:
    arch = ArchConfig.from_hf_dict({**MISTRAL, "sliding_window": None})
    assert arch.max_position_embeddings == 32768


def test_qwen2_window_is_ignored_when_disabled() -> None:
    config = {**MISTRAL, "model_type": "qwen2", "use_sliding_window": False}
    arch = ArchConfig.from_hf_dict(config)
    assert arch.max_position_embeddings == 32768
    assert arch.attention_bias


def test_unsupported_model_type_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="gpt_neox"):
        ArchConfig.from_hf_dict({**MISTRAL, "model_type": "gpt_neox"})
