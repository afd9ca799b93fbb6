"""load_weights copies each checkpoint tensor only into a parameter of exactly its shape."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.attention import get_attention_backend
from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.causal_lm import CausalLM
from kvserve.models.registry import build_model
from model_fixtures import tiny_arch_config, tiny_hf_config


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


def new_model(arch: ArchConfig) -> CausalLM:
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


@pytest.fixture(scope="module")
def gpt2_arch() -> ArchConfig:
    return ArchConfig.from_hf_dict(tiny_hf_config("gpt2", 96).to_dict())


@pytest.fixture(scope="module")
def gpt2_checkpoint(gpt2_arch: ArchConfig) -> dict[str, torch.Tensor]:
    """A complete tiny GPT2LMHeadModel checkpoint as transformers saves it (tied head left out)."""
    torch.manual_seed(0)
    state = transformers.GPT2LMHeadModel(tiny_hf_config("gpt2", 96)).state_dict()
    state.pop("lm_head.weight")
    return {name: tensor.clone() for name, tensor in state.items()}


def test_a_gpt2_checkpoint_loads_its_conv1d_weights_transposed(
    gpt2_arch: ArchConfig, gpt2_checkpoint: dict[str, torch.Tensor]
) -> None:
    model = new_model(gpt2_arch)
    model.load_weights(gpt2_checkpoint.items())
    stored = gpt2_checkpoint["transformer.h.1.attn.c_attn.weight"]  # [in, 3 * hidden]
    assert torch.equal(model.transformer.h[1].attn.c_attn.weight, stored.t())
    assert torch.equal(model.lm_head.weight, gpt2_checkpoint["transformer.wte.weight"])


def test_the_original_gpt2_names_load_and_its_mask_buffers_are_skipped(
    gpt2_arch: ArchConfig, gpt2_checkpoint: dict[str, torch.Tensor]
) -> None:
    # openai-community/gpt2 stores a bare GPT2Model: h.0..., wte, wpe, ln_f, plus the
    # causal mask (attn.bias) and attn.masked_bias buffers of old transformers versions.
    bare = {name.removeprefix("transformer."): tensor for name, tensor in gpt2_checkpoint.items()}
    n = gpt2_arch.max_position_embeddings
    for layer in range(gpt2_arch.num_hidden_layers):
        bare[f"h.{layer}.attn.bias"] = torch.ones(1, 1, n, n).tril()
        bare[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    model = new_model(gpt2_arch)
    model.load_weights(bare.items())
    assert torch.equal(model.transformer.ln_f.bias, gpt2_checkpoint["transformer.ln_f.bias"])


@pytest.mark.parametrize(
    "name",
    ["transformer.wpe.weight", "transformer.h.2.mlp.c_fc.bias", "transformer.ln_f.weight"],
)
def test_a_gpt2_checkpoint_missing_a_tensor_is_refused_naming_it(
    gpt2_arch: ArchConfig, gpt2_checkpoint: dict[str, torch.Tensor], name: str
) -> None:
    missing = {k: v for k, v in gpt2_checkpoint.items() if k != name}
    with pytest.raises(ModelLoadError) as excinfo:
        new_model(gpt2_arch).load_weights(missing.items())
    assert excinfo.value.field == name


@pytest.mark.parametrize(
    "name",
    [
        "transformer.h.3.attn.c_attn.weight",  # a layer the config does not have
        "transformer.h.0.attn.q_proj.weight",
        "transformer.h.0.crossattention.c_attn.weight",
    ],
)
def test_a_gpt2_checkpoint_with_an_extra_tensor_is_refused_naming_it(
    gpt2_arch: ArchConfig, gpt2_checkpoint: dict[str, torch.Tensor], name: str
) -> None:
    extra = {**gpt2_checkpoint, name: torch.zeros(64, 192)}
    with pytest.raises(ModelLoadError, match="has no place") as excinfo:
        new_model(gpt2_arch).load_weights(extra.items())
    assert excinfo.value.field == name


def test_a_gpt2_tensor_given_twice_or_untransposed_is_refused(
    gpt2_arch: ArchConfig, gpt2_checkpoint: dict[str, torch.Tensor]
) -> None:
    # The same tensor under its prefixed and its bare name.
    doubled = [
        *gpt2_checkpoint.items(),
        ("h.0.ln_1.bias", gpt2_checkpoint["transformer.h.0.ln_1.bias"]),
    ]
    with pytest.raises(ModelLoadError, match="appears twice"):
        new_model(gpt2_arch).load_weights(doubled)
    # An [out, in] matrix where Conv1D stores [in, out] (c_fc is 64 -> 256: not square).
    name = "transformer.h.0.mlp.c_fc.weight"
    flipped = {**gpt2_checkpoint, name: gpt2_checkpoint[name].t().clone()}
    with pytest.raises(ModelLoadError) as excinfo:
        new_model(gpt2_arch).load_weights(flipped.items())
    assert excinfo.value.field == name
