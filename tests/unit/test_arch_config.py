"""ArchConfig reads Hugging Face configs of the supported families."""

from __future__ import annotations

import pytest

from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.arch_limits import ARCH_LIMITS

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


def test_mistral_slides_every_layer_over_its_full_context() -> None:
    arch = ArchConfig.from_hf_dict(MISTRAL)
    assert arch.architecture == "llama"
    assert arch.max_position_embeddings == 32768  # the window no longer caps the context
    assert arch.sliding_window == 4096
    assert arch.layer_types == ("sliding_attention",) * 32
    assert arch.head_dim == 128
    assert arch.eos_token_ids == (2,)


def test_no_sliding_window_keeps_every_layer_global() -> None:
    arch = ArchConfig.from_hf_dict({**MISTRAL, "sliding_window": None})
    assert arch.max_position_embeddings == 32768
    assert arch.sliding_window is None and arch.layer_types is None


def test_qwen2_window_is_ignored_when_disabled() -> None:
    config = {**MISTRAL, "model_type": "qwen2", "use_sliding_window": False}
    arch = ArchConfig.from_hf_dict(config)
    assert arch.max_position_embeddings == 32768
    assert arch.sliding_window is None
    assert arch.attention_bias


def test_qwen2_slides_the_layers_from_max_window_layers_on() -> None:
    config = {**MISTRAL, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 28}
    arch = ArchConfig.from_hf_dict(config)
    assert arch.layer_types == ("full_attention",) * 28 + ("sliding_attention",) * 4
    assert [arch.layer_sliding_window(i) for i in (27, 28)] == [None, 4096]


def test_unsupported_model_type_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="gpt_neox"):
        ArchConfig.from_hf_dict({**MISTRAL, "model_type": "gpt_neox"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_attention_heads", 0),
        ("num_attention_heads", -4),
        ("num_key_value_heads", 5),  # 32 heads are not a multiple of 5
        ("num_key_value_heads", 64),  # more KV heads than heads
        ("vocab_size", 2**40),
        ("vocab_size", 0),
        ("hidden_size", 2**20),
        ("hidden_size", 4097),  # not a multiple of 32 heads, and no head_dim
        ("intermediate_size", -1),
        ("num_hidden_layers", 10**6),
        ("max_position_embeddings", 2**30),
        ("head_dim", 0),
        ("head_dim", 127),  # RoPE needs pairs
        ("hidden_size", 4096.0),
        ("vocab_size", "32000"),
        ("num_hidden_layers", True),
        ("num_hidden_layers", None),
        ("rms_norm_eps", 0.0),
        ("rms_norm_eps", float("nan")),
        ("rms_norm_eps", "1e-5"),
        ("rope_theta", float("inf")),
        ("rope_theta", -1.0),
        ("sliding_window", -5),
        ("eos_token_id", "2"),
        ("eos_token_id", [2, [3]]),
        ("bos_token_id", 1.5),
        ("tie_word_embeddings", 1),
        ("attention_bias", "false"),
        ("rope_scaling", ["linear", 2.0]),
        ("rope_scaling", {"rope_type": "linear", "factor": 0.0}),
        ("rope_scaling", {"rope_type": "linear"}),
        (
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ],
)
def test_out_of_range_or_mistyped_values_are_refused_naming_the_key(
    key: str, value: object
) -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        ArchConfig.from_hf_dict({**MISTRAL, key: value})
    assert excinfo.value.field is not None
    assert excinfo.value.field.split(".")[0] == key or (
        key == "num_attention_heads" and excinfo.value.field == "num_key_value_heads"
    )
    assert str(excinfo.value).startswith("model: ")


def test_values_at_the_limits_are_accepted() -> None:
    for key, (low, high) in ARCH_LIMITS.items():
        for value in (low, high):
            fields = {**SMALL, key: value}
            if key in ("num_attention_heads", "num_key_value_heads"):
                fields |= {"num_attention_heads": value, "num_key_value_heads": value}
            if value == 0:
                continue  # only num_hidden_layers allows 0; covered below
            arch = ArchConfig(**fields)
            assert getattr(arch, key) == value
    assert ArchConfig(**{**SMALL, "num_hidden_layers": 0}).num_hidden_layers == 0


def test_the_published_configs_of_large_models_pass() -> None:
    llama_405b = {
        **MISTRAL,
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": None,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    arch = ArchConfig.from_hf_dict(llama_405b)
    # 405.8 billion weights, as published (untied head).
    assert 405e9 < arch.num_parameters() < 406e9


# Fields of a tiny config, for the ArchConfig constructor.
SMALL = {
    "architecture": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


# The config.json of the original 124M GPT-2 (openai-community/gpt2), its model keys.
GPT2_124M = {
    "model_type": "gpt2",
    "activation_function": "gelu_new",
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "layer_norm_epsilon": 1e-05,
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
}


def test_gpt2_config_is_read_from_its_own_keys() -> None:
    arch = ArchConfig.from_hf_dict(GPT2_124M)
    assert arch.architecture == "gpt2"
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads) == (768, 12, 12)
    assert (arch.num_key_value_heads, arch.head_dim) == (12, 64)
    assert arch.intermediate_size == 4 * 768  # n_inner absent (or null)
    assert arch.max_position_embeddings == 1024
    assert arch.rms_norm_eps == 1e-5
    assert arch.hidden_act == "gelu_new"
    assert arch.tie_word_embeddings and arch.attention_bias and not arch.uses_rope
    assert (arch.bos_token_id, arch.eos_token_ids) == (50256, (50256,))
    # 124,439,808: the published count (tied head).
    assert arch.num_parameters() == 124_439_808
    inner = ArchConfig.from_hf_dict({**GPT2_124M, "n_inner": 1000})
    assert inner.intermediate_size == 1000


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("n_embd", 0),
        ("n_embd", 770),  # not a multiple of 12 heads
        ("n_head", -1),
        ("n_layer", "12"),
        ("n_positions", 2**30),
        ("n_inner", 2**40),
        ("vocab_size", None),
        ("layer_norm_epsilon", 0.0),
        ("activation_function", "swish"),
        ("scale_attn_by_inverse_layer_idx", True),
        ("scale_attn_weights", False),
        ("add_cross_attention", True),
        ("tie_word_embeddings", "yes"),
        ("eos_token_id", "50256"),
    ],
)
def test_bad_gpt2_values_are_refused_naming_the_config_key(key: str, value: object) -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        ArchConfig.from_hf_dict({**GPT2_124M, key: value})
    assert excinfo.value.field == key
    assert str(excinfo.value).startswith("model: ")


def test_gpt2_takes_gelu_activations_only() -> None:
    with pytest.raises(ModelLoadError, match="gelu_new") as excinfo:
        ArchConfig(**{**SMALL, "architecture": "gpt2", "hidden_act": "silu"})
    assert excinfo.value.field == "hidden_act"


def test_only_rope_models_need_an_even_head_dim() -> None:
    odd = {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 15}
    with pytest.raises(ModelLoadError):
        ArchConfig(**odd)
    assert ArchConfig(**{**odd, "architecture": "gpt2", "hidden_act": "gelu_new"}).head_dim == 15
