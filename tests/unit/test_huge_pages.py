"""Weights on transparent huge pages: ``kernels/huge_pages.py`` and the CPU plan's move.

The copies must hold the same bytes in one private anonymous mapping advised
``MADV_HUGEPAGE`` (the ``hg`` flag in ``/proc/self/smaps``), a mapped source's
pages must leave the resident set, and an engine whose weights moved must
compute exactly what one whose weights stayed computes.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from test_loader_quantized import PROMPT, prompt_logits

from kvserve.engine import LLMEngine
from kvserve.errors import InvalidParameterError
from kvserve.kernels import huge_pages, native_ops
from kvserve.kernels.huge_pages import (
    HUGE_PAGE_BYTES,
    HUGE_PAGES_ENV,
    huge_pages_wanted,
    to_huge_pages,
)
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.linear import Linear
from kvserve.layers.weight_format import QuantizedWeights
from model_fixtures import smollm2_gguf_path
from proc_maps import linux_only, mapping_of

advisable = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform"
)


def on_huge_pages(tensor: torch.Tensor) -> bool:
    mapping = mapping_of(tensor.data_ptr())
    return mapping.path == "" and "hg" in mapping.flags


@linux_only
@advisable
def test_copies_hold_the_same_values_in_one_advised_mapping() -> None:
    generator = torch.Generator().manual_seed(0)
    sources = [
        torch.randn(300, 700, generator=generator),
        torch.arange(1001, dtype=torch.int64),
        torch.randn(5, 63, generator=generator).to(torch.bfloat16),
        torch.randint(0, 256, (777,), dtype=torch.uint8, generator=generator),
    ]
    copies = to_huge_pages(sources)
    assert copies[0].data_ptr() % HUGE_PAGE_BYTES == 0
    first = mapping_of(copies[0].data_ptr())
    for source, copy in zip(sources, copies, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape
        assert torch.equal(copy, source)
        assert copy.data_ptr() % 64 == 0 and copy.data_ptr() != source.data_ptr()
        assert on_huge_pages(copy)
        mapping = mapping_of(copy.data_ptr())
        assert (mapping.path, mapping.flags) == (first.path, first.flags)
    copies[0].zero_()  # a copy of its own: the source is untouched
    assert sources[0].abs().sum() > 0
    del sources
    assert int(copies[1].sum()) == 1000 * 1001 // 2  # the mapping outlives the sources
    assert to_huge_pages([]) == []


def test_only_contiguous_cpu_tensors_move() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        to_huge_pages([torch.zeros(4, 4).t()])


@linux_only
def test_a_mapped_sources_pages_leave_the_resident_set(tmp_path: Path) -> None:
    data = np.random.default_rng(1).integers(0, 256, size=64 * 4096, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    assert int(mapped.sum()) == int(data.sum())  # every page read once
    assert mapping_of(mapped.data_ptr()).rss_kib >= 64 * 4
    (copy,) = to_huge_pages([mapped])
    assert mapping_of(mapped.data_ptr()).rss_kib <= 4  # only a partial page may stay
    assert torch.equal(copy, torch.from_numpy(data))


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    assert huge_pages_wanted() == hasattr(mmap, "MADV_HUGEPAGE")
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    assert not huge_pages_wanted()
    monkeypatch.setenv(HUGE_PAGES_ENV, "sometimes")
    with pytest.raises(InvalidParameterError, match=f"{HUGE_PAGES_ENV}.*auto"):
        huge_pages_wanted()
    monkeypatch.setenv(HUGE_PAGES_ENV, "auto")
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "never")
    assert not huge_pages_wanted()  # the kernel would not give them
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: None)
    assert not huge_pages_wanted()


def engine_weights(engine: LLMEngine) -> list[torch.Tensor]:
    """Every quantized block and every float weight of 64 KiB or more the model streams."""
    tensors = []
    for module in engine.runner.model.modules():
        qweight = None
        if isinstance(module, Linear) and isinstance(module.format, QuantizedWeights):
            qweight = module.format.qweight
        elif isinstance(module, VocabEmbedding):
            qweight = module.qweight
        if qweight is not None:
            tensors += [segment.data for segment in qweight.segments]
    tensors += [
        p for p in engine.runner.model.parameters() if p.numel() * p.element_size() >= 1 << 16
    ]
    return tensors


@pytest.mark.slow
@linux_only
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_an_engine_on_huge_pages_computes_what_one_without_does(
    quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if smollm2_gguf_path() is None:
        pytest.skip("the SmolLM2 GGUF is not installed")
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    if not huge_pages_wanted():
        pytest.skip("this kernel gives no transparent huge pages")
    args = dict(quantization=quantization, num_blocks=16, max_model_len=128)
    moved = LLMEngine.from_engine_args("smollm2-135m-instruct", **args)
    if native_ops() is None:
        pytest.skip("the C kernels do not build here: weights stay where they were loaded")
    weights = engine_weights(moved)
    assert len(weights) >= 4 * 30
    assert all(on_huge_pages(weight) for weight in weights)
    if quantization == "auto":  # SmolLM2's file ties the LM head to the quantized table
        assert any(
            isinstance(m, VocabEmbedding) and m.qweight for m in moved.runner.model.modules()
        )

    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    stayed = LLMEngine.from_engine_args("smollm2-135m-instruct", **args)
    assert not any(on_huge_pages(weight) for weight in engine_weights(stayed))
    assert torch.equal(prompt_logits(moved, PROMPT), prompt_logits(stayed, PROMPT))


@linux_only
def test_joined_pieces_of_a_fused_weight_leave_their_file_pages(tmp_path: Path) -> None:
    # gate and up (or q, k and v) of one type become one segment, a copy: the file's
    # pages read to make it must not stay resident beside it (they did: ~460 MiB of
    # a 1.06 GB Q4_K_M file).
    from gguf import GGMLQuantizationType

    from kvserve.kernels.quant_weight import QuantizedTensor
    from kvserve.layers.linear import _merge_segments

    q8 = GGMLQuantizationType.Q8_0
    rows, in_features, row_bytes = 256, 256, 8 * 34  # Q8_0: 34 bytes per 32 values
    data = np.random.default_rng(2).integers(0, 256, size=2 * rows * row_bytes, dtype=np.uint8)
    path = tmp_path / "fused.bin"
    data.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")).view(2 * rows, row_bytes)
    pieces = [
        QuantizedTensor(q8, rows, in_features, mapped[i * rows : (i + 1) * rows]) for i in (0, 1)
    ]
    (segment,) = _merge_segments(pieces)
    assert torch.equal(segment.data, torch.from_numpy(data).view(2 * rows, row_bytes))
    assert mapping_of(mapped.data_ptr()).rss_kib <= 2 * 4  # partial first and last pages at most


@linux_only
@advisable
def test_a_model_smaller_than_a_cache_stays_where_it_was_loaded() -> None:
    from torch import nn

    from kvserve.worker.cpu_weights import HUGE_PAGES_MIN_MODEL_BYTES, move_weights_to_huge_pages

    def model_of(nbytes: int) -> nn.Module:
        model = nn.Module()
        model.weight = nn.Parameter(torch.ones(nbytes // 4), requires_grad=False)
        model.norm = nn.Parameter(torch.ones(16), requires_grad=False)  # too small to move
        return model

    small = model_of(HUGE_PAGES_MIN_MODEL_BYTES // 2)
    where = small.weight.data_ptr()
    assert move_weights_to_huge_pages(small) == 0
    assert small.weight.data_ptr() == where
    large = model_of(HUGE_PAGES_MIN_MODEL_BYTES)
    norm = large.norm.data_ptr()
    assert move_weights_to_huge_pages(large) == HUGE_PAGES_MIN_MODEL_BYTES
    assert on_huge_pages(large.weight) and bool(large.weight.eq(1).all())
    assert large.norm.data_ptr() == norm
