"""Two tables decide what kvserve runs: the families (and their model types) and each one's class."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import get_attention_backend
from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig
from kvserve.models.families import FAMILIES, architecture_of_model_type, check_architecture
from kvserve.models.registry import MODEL_CLASSES, build_model
from model_fixtures import TINY_KINDS, TINY_MODEL_CLASSES, tiny_hf_config

ALL_MODEL_TYPES = [t for family in FAMILIES.values() for t in family.hf_model_types]


def tiny_arch(kind: str) -> ArchConfig:
    return ArchConfig.from_hf_dict(tiny_hf_config(kind, 96).to_dict())


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_each_family_builds_the_class_its_table_row_names(kind: str) -> None:
    arch = tiny_arch(kind)
    backend = get_attention_backend(
        "torch_paged",
        torch.float32,
        torch.device("cpu"),
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    model = build_model(arch, 64, torch.float32, backend)
    assert type(model) is MODEL_CLASSES[arch.architecture]


def test_every_family_has_a_model_class_and_every_class_a_family() -> None:
    assert MODEL_CLASSES.keys() == FAMILIES.keys()


@pytest.mark.parametrize("model_type", ALL_MODEL_TYPES)
def test_every_listed_model_type_maps_to_its_architecture(model_type: str) -> None:
    architecture = architecture_of_model_type(model_type)
    assert model_type in FAMILIES[architecture].hf_model_types


def test_an_unsupported_model_type_is_refused_listing_the_supported_ones() -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        ArchConfig.from_hf_dict({"model_type": "mamba", "hidden_size": 64})
    message = str(excinfo.value)
    assert excinfo.value.field == "model_type"
    assert "'mamba' is not supported" in message
    for model_type in ALL_MODEL_TYPES:
        assert model_type in message


def test_an_unsupported_architecture_is_refused_listing_the_supported_ones() -> None:
    for refuse in (
        lambda: check_architecture("gpt_neox"),
        lambda: ArchConfig(**{**tiny_arch("llama").__dict__, "architecture": "gpt_neox"}),
    ):
        with pytest.raises(ModelLoadError) as excinfo:
            refuse()
        assert excinfo.value.field == "architecture"
        for architecture in FAMILIES:
            assert architecture in str(excinfo.value)


@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("tied", [True, False])
def test_num_parameters_counts_what_transformers_holds(kind: str, tied: bool) -> None:
    config = tiny_hf_config(kind, 96)
    config.tie_word_embeddings = tied
    if kind == "gpt2":
        config.n_inner = 100  # a width other than 4 * n_embd
    reference = TINY_MODEL_CLASSES[kind](config)
    assert ArchConfig.from_hf_dict(config.to_dict()).num_parameters() == (
        reference.num_parameters()
    )
