"""The bench's random-weight models have the tensors transformers' own classes hold."""

import pytest
import torch
import transformers

from kvserve.benchmarks.workloads.shaped_models import SHAPES, write_shaped_model


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_match_the_families_hugging_face_classes(name: str) -> None:
    shape = SHAPES[name]
    config = transformers.AutoConfig.for_model(**shape.config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {
        key: tuple(value.shape)
        for key, value in model.state_dict().items()
        if not key.endswith((".attn.bias", ".attn.masked_bias"))  # GPT-2's mask buffers
        and not (config.tie_word_embeddings and key == "lm_head.weight")
    }
    assert dict(shape.tensors()) == expected


def test_an_unknown_shape_is_refused_naming_the_choices(tmp_path) -> None:
    with pytest.raises(ValueError, match="shape must be one of"):
        write_shaped_model("gpt5", tmp_path)
