"""Repacked quantized segments are cached in the model's entry and mapped on the next start.

A tiny Llama GGUF whose matrices are all Q4_K (random blocks: gguf's Python
quantizer has no Q4_K) is served three ways: without the cache, with the
cache building the repacked file, and reading it. The outputs must be the
same float for float; the reading load must repack nothing and hand the
kernels views of the cached file. Damaged or foreign files are refused with
a warning, and the load rewrites them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import gguf_fixtures
from gguf_fixtures import TinySpec, with_tiny_tokenizer, write_gguf
from kvserve import LLM, SamplingParams
from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.huge_pages import HUGE_PAGES_ENV
from kvserve.kernels.quant_weight import QuantWeight
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.linear import Linear
from kvserve.layers.weight_format import QuantizedWeights
from kvserve.loader import resolve_model
from kvserve.loader.model_cache import model_cache_entry
from kvserve.loader.source import ModelSource

Q = gguf.GGMLQuantizationType
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

pytestmark = [
    pytest.mark.skipif(
        not Path("/proc/self/maps").exists(), reason="checks mappings in Linux's /proc"
    ),
    pytest.mark.usefixtures("cache_dir"),
]


@pytest.fixture(autouse=True)
def _weights_stay_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """What these tests check is the cache's own mapping: with the weights moved onto
    huge pages after loading (``kernels/huge_pages.py``, tested on its own), every
    segment would be an anonymous copy, whatever the cache handed the kernels."""
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")


@pytest.fixture
def kernels() -> NativeOps:
    ops = native_ops()
    if ops is None or Q.Q4_K not in ops.repack_layouts:
        pytest.skip("these kernels do not repack Q4_K (no C compiler, or no AVX2)")
    return ops


def random_q4_k(array: np.ndarray, seed: int) -> np.ndarray:
    """Random Q4_K blocks for a ``[rows, cols]`` matrix, with fp16 d and dmin small
    enough that two layers of them keep the activations finite."""
    rows, cols = array.shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-3, size=(rows, cols // 256, 2)).astype(np.float16)
    blocks[..., :4] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture
def q4_k_source(tmp_path: Path) -> ModelSource:
    """A tiny Llama GGUF (hidden 256: one Q4_K block per row) with every matrix in Q4_K."""
    quantize = gguf.quants.quantize
    seeds = iter(range(1000))

    def q4_k_types(spec: TinySpec, weights: dict[str, np.ndarray]) -> dict[str, Q]:
        return {name: Q.Q4_K if array.ndim == 2 else Q.F32 for name, array in weights.items()}

    def quantize_q4_k(array: np.ndarray, qtype: Q) -> np.ndarray:
        return random_q4_k(array, next(seeds)) if qtype == Q.Q4_K else quantize(array, qtype)

    spec = TinySpec(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256, tied=False)
    path = tmp_path / "model" / "tiny-q4_k.gguf"
    path.parent.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_fixtures, "tensor_types", q4_k_types)
        patch.setattr(gguf.quants, "quantize", quantize_q4_k)
        write_gguf(path, with_tiny_tokenizer(spec, CHAT_TEMPLATE))
    return resolve_model(str(path))


def repacked_file(source: ModelSource, ops: NativeOps) -> Path:
    entry = model_cache_entry(source)
    assert entry is not None
    ids = "-".join(str(i) for i in sorted(set(ops.repack_layouts.values())))
    return entry.folder / f"weights-repacked-{ids}.safetensors"


class Served:
    """What one engine start computed, and how its kernels got their Q4_K segments."""

    def __init__(self, llm: LLM, repacked_rows: list[int]) -> None:
        conversation = [{"role": "user", "content": "The quick brown fox"}]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
        completion = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0]
        self.output = (completion.token_ids, completion.logprobs)
        self.repacked_rows = list(repacked_rows)
        model = llm.llm_engine.runner.model
        self.weights: dict[str, QuantWeight] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and isinstance(module.format, QuantizedWeights):
                self.weights[name] = module.format.qweight
            if isinstance(module, VocabEmbedding) and module.qweight is not None:
                self.weights[name] = module.qweight

    def segment_files(self) -> set[str]:
        """The file each Q4_K segment's blocks are mapped from ("" for anonymous memory)."""
        return {
            mapped_file(segment.data.data_ptr())
            for weight in self.weights.values()
            for segment in weight.segments
            if segment.qtype == Q.Q4_K
        }


def assert_maps_the_cached_file(served: Served, path: Path) -> None:
    """A start that found a sound repacked file: it repacks only the few rows of each segment
    it checks against the file, and every Q4_K segment is a view of ``path``."""
    assert max(served.repacked_rows) <= 4
    assert served.segment_files() == {str(path)}


def mapped_file(address: int) -> str:
    """The file mapped at ``address``; "" for anonymous memory (the heap included)."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(v, 16) for v in fields[0].split("-"))
            if low <= address < high:
                name = fields[5].strip() if len(fields) == 6 else ""
                return name if name.startswith("/") else ""
    raise AssertionError(f"{address:#x} is not mapped")


@pytest.fixture
def serve(
    q4_k_source: ModelSource, kernels: NativeOps, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], Served]:
    """Start an engine on the Q4_K file (quantization 'auto' keeps its blocks) and run it,
    counting the rows the kernels repack."""
    rows: list[int] = []
    repack_rows = kernels.repack_rows

    def counting(qtype: Q, data: torch.Tensor) -> torch.Tensor:
        rows.append(int(data.shape[0]))
        return repack_rows(qtype, data)

    monkeypatch.setattr(kernels, "repack_rows", counting)

    def run() -> Served:
        rows.clear()
        llm = LLM(str(q4_k_source.path), dtype="float32", block_size=4, num_blocks=64)
        return Served(llm, rows)

    return run


def test_second_start_maps_the_repacked_segments_and_computes_the_same(
    serve: Callable[[], Served],
    q4_k_source: ModelSource,
    kernels: NativeOps,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "0")
    uncached = serve()
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "1")
    path = repacked_file(q4_k_source, kernels)
    assert not path.exists()
    building = serve()
    assert path.exists() and path.stat().st_mode & 0o777 == 0o600
    reading = serve()

    # 2 layers of qkv, o, gate_up, down (a fused run of one type is one segment), the
    # embedding table and lm_head: every Q4_K segment, repacked in full once.
    num_segments = sum(len(w.segments) for w in building.weights.values())
    assert num_segments == 2 * 4 + 2
    segment_rows = [s.rows for w in building.weights.values() for s in w.segments]
    assert sorted(building.repacked_rows) == sorted(segment_rows)
    assert building.segment_files() == {""}  # the first start keeps its own copies
    # The second repacks only the few rows of each segment it checks, and maps the rest.
    assert len(reading.repacked_rows) == num_segments
    assert_maps_the_cached_file(reading, path)
    for name, weight in reading.weights.items():
        for stored, built in zip(weight.segments, building.weights[name].segments, strict=True):
            assert stored.repacked and built.repacked, name
            assert torch.equal(stored.data, built.data), name
    with safe_open(str(path), framework="pt") as cached:
        metadata = cached.metadata()
        assert metadata["kernel_type:model.layers.0.mlp.gate_up_proj#0"] == "112"
        assert metadata["qtype:model.embed_tokens#0"] == "Q4_K"
    assert building.output == uncached.output
    assert reading.output == uncached.output


def test_the_cache_switched_off_writes_no_repacked_file(
    serve: Callable[[], Served],
    q4_k_source: ModelSource,
    kernels: NativeOps,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "0")
    served = serve()
    assert served.repacked_rows and served.segment_files() == {""}
    assert not list(cache_dir.rglob("weights-repacked-*"))


def rewrite(path: Path, change: Callable[[dict[str, torch.Tensor], dict[str, str]], None]) -> None:
    """``path`` saved again (owner-only, as the cache wants) after ``change`` edits its tensors
    and metadata."""
    with safe_open(str(path), framework="pt") as stored:
        metadata = dict(stored.metadata())
        tensors = {name: stored.get_tensor(name).clone() for name in stored.keys()}  # noqa: SIM118
    change(tensors, metadata)
    path.unlink()
    save_file(tensors, str(path), metadata)
    path.chmod(0o600)


def reorder_rows(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The q rows of one layer in another order, as a changed RoPE row order would give."""
    data = tensors["model.layers.1.self_attn.qkv_proj#0"]
    data[:256] = data[:256].flip(0).clone()


def other_layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    metadata["layouts"] = "Q4_K=999"


def another_segments_blocks(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """gate_up's blocks under down's name: the same shape, another tensor."""
    up, down = "model.layers.0.mlp.gate_up_proj#0", "model.layers.0.mlp.down_proj#0"
    tensors[down] = tensors[up][: tensors[down].shape[0]].clone()


DAMAGES: dict[str, Callable[[Path], Any]] = {
    "truncated": lambda path: os.truncate(path, path.stat().st_size // 2),
    "garbage": lambda path: path.write_bytes(b"\xff" * 64),
    "writable by others": lambda path: path.chmod(0o666),
    "other layout": lambda path: rewrite(path, other_layout),
    "rows reordered": lambda path: rewrite(path, reorder_rows),
    "another tensor's blocks": lambda path: rewrite(path, another_segments_blocks),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_bad_repacked_file_is_refused_with_a_warning_and_rewritten(
    serve: Callable[[], Served],
    q4_k_source: ModelSource,
    kernels: NativeOps,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    building = serve()
    path = repacked_file(q4_k_source, kernels)
    DAMAGES[damage](path)
    with caplog.at_level(logging.WARNING, logger="kvserve.loader.repacked_cache"):
        refused = serve()
    warnings = [r for r in caplog.records if r.name == "kvserve.loader.repacked_cache"]
    assert len(warnings) == 1 and "rebuilding" in warnings[0].getMessage(), caplog.text
    assert refused.output == building.output
    # Segments that passed their checks may still be views of the replaced file.
    replaced = {name.removesuffix(" (deleted)") for name in refused.segment_files()}
    assert replaced <= {"", str(path)}
    # Rewritten: the next start maps every segment again.
    caplog.clear()
    reading = serve()
    assert_maps_the_cached_file(reading, path)
    assert reading.output == building.output
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_full_disk_costs_a_warning_not_the_load(
    serve: Callable[[], Served],
    q4_k_source: ModelSource,
    kernels: NativeOps,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvserve.loader import safetensors_writer

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_writer.tempfile, "TemporaryFile", full)
    with caplog.at_level(logging.WARNING):
        served = serve()
    assert "No space left on device" in caplog.text
    assert served.segment_files() == {""}
    assert not repacked_file(q4_k_source, kernels).exists()
