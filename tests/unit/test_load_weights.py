"""load_weights copies each checkpoint tensor only into a parameter of exactly its shape."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.attention import get_attention_backend
from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.registry import build_model
from model_fixtures import tiny_arch_config


@pytest.fixture(scope="module")
def arch() -> ArchConfig:
    return tiny_arch_config()


@pytest.fixture(scope="module")
def checkpoint(arch: ArchConfig) -> dict[str, torch.Tensor]:
    """A complete checkpoint of the tiny Llama, as transformers stores it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    state = transformers.LlamaForCausalLM(config).state_dict()
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight")
    return {name: tensor.clone() for name, tensor in state.items()}


def new_model(arch: ArchConfig) -> LlamaForCausalLM:
    backend = get_attention_backend(
        "torch_paged",
        torch.float32,
        torch.device("cpu"),
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    return build_model(arch, 64, torch.float32, backend)


def test_a_complete_checkpoint_loads(arch: ArchConfig, checkpoint: dict[str, torch.Tensor]) -> None:
    model = new_model(arch)
    model.load_weights(checkpoint.items())
    assert torch.equal(model.model.norm.weight, checkpoint["model.norm.weight"])


@pytest.mark.parametrize(
    ("name", "make_bad"),
    [
        # Each of these would broadcast in Tensor.copy_ and load silently.
        ("model.norm.weight", lambda t: t[:1].clone()),
        ("model.layers.1.input_layernorm.weight", lambda t: t.reshape(1, -1).clone()),
        ("model.embed_tokens.weight", lambda t: t[:1].clone()),
        ("model.embed_tokens.weight", lambda t: t[:, :1].clone()),
        ("model.layers.0.self_attn.k_proj.weight", lambda t: t[:1].clone()),
        ("model.layers.0.mlp.up_proj.weight", lambda t: t.t().clone()),
        # Integers would be converted to float weights.
        ("model.norm.weight", lambda t: t.to(torch.int32)),
        ("model.layers.0.self_attn.q_proj.weight", lambda t: t.to(torch.int8)),
    ],
)
def test_a_tensor_of_the_wrong_shape_or_kind_is_refused_by_name(
    arch: ArchConfig,
    checkpoint: dict[str, torch.Tensor],
    name: str,
    make_bad: object,
) -> None:
    assert callable(make_bad)
    model = new_model(arch)
    bad = {**checkpoint, name: make_bad(checkpoint[name])}
    with pytest.raises(ModelLoadError) as excinfo:
        model.load_weights(bad.items())
    assert excinfo.value.field == name
    assert name in str(excinfo.value)


def test_a_tensor_given_twice_is_refused(
    arch: ArchConfig, checkpoint: dict[str, torch.Tensor]
) -> None:
    name = "model.layers.0.post_attention_layernorm.weight"
    doubled = [*checkpoint.items(), (name, checkpoint[name])]
    with pytest.raises(ModelLoadError) as excinfo:
        new_model(arch).load_weights(doubled)
    assert excinfo.value.field == name


def test_missing_and_unknown_tensors_are_named(
    arch: ArchConfig, checkpoint: dict[str, torch.Tensor]
) -> None:
    missing = {k: v for k, v in checkpoint.items() if k != "model.norm.weight"}
    with pytest.raises(ModelLoadError) as excinfo:
        new_model(arch).load_weights(missing.items())
    assert excinfo.value.field == "model.norm.weight"
    unknown = {**checkpoint, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(ModelLoadError) as excinfo:
        new_model(arch).load_weights(unknown.items())
    assert excinfo.value.field == "model.layers.9.mlp.up_proj.weight"
