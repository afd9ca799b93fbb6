"""SafetensorsWriter: streamed files read back by safetensors itself; failures leave nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvserve.loader.safetensors_writer import SafetensorsWriter


def test_tensors_of_mixed_dtypes_and_shapes_read_back_exactly(tmp_path: Path) -> None:
    tensors = {
        "matrix": torch.randn(5, 3),
        "half": torch.randn(7).to(torch.bfloat16),
        "strided": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.empty(0, 4),
        "flags": torch.tensor([True, False, True]),
    }
    target = tmp_path / "out.safetensors"
    with SafetensorsWriter(target, {"format": "1"}) as writer:
        for name, tensor in tensors.items():
            writer.add(name, tensor)
    assert writer.committed
    assert (8 + int.from_bytes(target.read_bytes()[:8], "little")) % 8 == 0
    with safe_open(str(target), framework="pt") as stored:
        assert stored.metadata() == {"format": "1"}
        assert set(stored.keys()) == set(tensors)
        for name, tensor in tensors.items():
            read = stored.get_tensor(name)
            assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


def test_an_interrupted_write_leaves_no_file(tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    with pytest.raises(KeyboardInterrupt), SafetensorsWriter(target, {}) as writer:
        writer.add("a", torch.ones(3))
        raise KeyboardInterrupt
    assert not writer.committed
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_it_cannot_store_turns_it_off_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "out.safetensors"
    with caplog.at_level(logging.WARNING), SafetensorsWriter(target, {}) as writer:
        writer.add("a", torch.ones(3))
        writer.add("a", torch.ones(3))
        writer.add("b", torch.ones(3))
    assert not writer.committed
    assert "not caching" in caplog.text and "twice" in caplog.text
    assert list(tmp_path.iterdir()) == []
