"""Weights quantized at load from a GGUF file are cached once, then memory-mapped as they are."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch

from gguf_fixtures import TinySpec, write_gguf
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.loader import CachedWeights, ModelSource, WeightOrigin, load_arch_config, resolve_model
from kvserve.loader import quantize as quantize_module
from kvserve.loader.model_cache import model_cache_entry
from kvserve.loader.quantize import CheckpointValue, quantize_weights

pytestmark = pytest.mark.usefixtures("cache_dir")


@pytest.fixture
def gguf_source(tmp_path: Path) -> ModelSource:
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    write_gguf(path, TinySpec(tied=False))
    return resolve_model(str(path))


@pytest.fixture
def quantized_count(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One entry per tensor quantized during the test."""
    calls: list[str] = []
    original = quantize_module.quantize_tensor

    def counting(weight: torch.Tensor, qname: str) -> QuantizedTensor:
        calls.append(qname)
        return original(weight, qname)

    monkeypatch.setattr(quantize_module, "quantize_tensor", counting)
    return calls


def load(
    source: ModelSource, quantization: str, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, CheckpointValue], WeightOrigin]:
    weights = CachedWeights(source, load_arch_config(source), dtype, quantization)
    return dict(weights), weights.origin


def assert_same(first: dict[str, CheckpointValue], second: dict[str, CheckpointValue]) -> None:
    assert first.keys() == second.keys()
    for name, value in first.items():
        other = second[name]
        if isinstance(value, QuantizedTensor):
            assert isinstance(other, QuantizedTensor), name
            assert (value.qtype, value.shape) == (other.qtype, other.shape), name
            assert torch.equal(value.data, other.data), name
        else:
            assert isinstance(other, torch.Tensor) and torch.equal(value, other), name


def test_quantized_weights_are_built_once_then_read_back(
    gguf_source: ModelSource, quantized_count: list[str]
) -> None:
    first, origin = load(gguf_source, "q4_0")
    assert origin is WeightOrigin.SOURCE_CACHED
    assert quantized_count
    entry = model_cache_entry(gguf_source)
    assert entry is not None and (entry.folder / "weights-q4_0.safetensors").is_file()
    # The same as quantizing the file's stream directly.
    arch = load_arch_config(gguf_source)
    direct = dict(quantize_weights(CachedWeights(gguf_source, arch, torch.float32), "q4_0", arch))
    assert_same(first, direct)
    quantized_count.clear()
    second, origin = load(gguf_source, "q4_0", torch.bfloat16)  # any dtype: floats are float32
    assert origin is WeightOrigin.CACHE
    assert not quantized_count
    assert_same(first, second)
    assert isinstance(second["model.embed_tokens.weight"], QuantizedTensor)
    assert isinstance(second["model.layers.0.self_attn.q_proj.weight"], QuantizedTensor)


def test_each_quantization_has_its_own_file(gguf_source: ModelSource) -> None:
    q8, _ = load(gguf_source, "q8_0")
    q4, origin = load(gguf_source, "q4_0")
    assert origin is WeightOrigin.SOURCE_CACHED
    table8, table4 = q8["model.embed_tokens.weight"], q4["model.embed_tokens.weight"]
    assert isinstance(table8, QuantizedTensor) and isinstance(table4, QuantizedTensor)
    assert (table8.qtype.name, table4.qtype.name) == ("Q8_0", "Q4_0")
    # The float conversion cache is another file again.
    _, origin = load(gguf_source, "auto")
    assert origin is WeightOrigin.SOURCE_CACHED


def rewrite_metadata(path: Path, key: str, value: str) -> None:
    """Change one metadata entry of a safetensors file in place, header length kept."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"][key] = value
    encoded = json.dumps(header).encode()
    assert len(encoded) <= length
    path.write_bytes(data[:8] + encoded.ljust(length) + data[8 + length :])


def test_a_cached_tensor_of_a_wrong_type_is_rebuilt(
    gguf_source: ModelSource, caplog: pytest.LogCaptureFixture
) -> None:
    first, _ = load(gguf_source, "q8_0")
    entry = model_cache_entry(gguf_source)
    assert entry is not None
    path = entry.folder / "weights-q8_0.safetensors"
    # A row of two 34-byte Q8_0 blocks (68 bytes) is not whole 144-byte Q4_K blocks.
    rewrite_metadata(path, "qtype:model.embed_tokens.weight", "Q4_K")
    with caplog.at_level(logging.WARNING):
        second, origin = load(gguf_source, "q8_0")
    assert origin is WeightOrigin.SOURCE_CACHED
    assert "rebuilding" in caplog.text
    assert_same(first, second)
