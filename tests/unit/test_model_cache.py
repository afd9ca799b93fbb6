"""The converted-model cache: GGUF config, tokenizer and weights are built once, then read back.

Tiny GGUF files are written on the spot (see test_loader_gguf); one carries a
real byte-level BPE tokenizer so the engine can run end to end.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_fixtures import TinySpec, with_tiny_tokenizer, write_gguf
from kvserve import LLM, SamplingParams
from kvserve.attention import get_attention_backend
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.loader import (
    CachedWeights,
    ModelSource,
    WeightOrigin,
    gguf_weights,
    iter_weights,
    load_arch_config,
    load_tokenizer,
    model_cache,
    resolve_model,
    source_digest,
)
from kvserve.loader import tokenizer as tokenizer_module
from kvserve.loader.gguf_types import GGUFTensor
from kvserve.loader.model_cache import FORMAT_VERSION, model_cache_entry, producer_digest
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.registry import build_model
from model_fixtures import train_tiny_tokenizer

OTHER_UID = 65534  # "nobody"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

pytestmark = pytest.mark.usefixtures("cache_dir")


def tiny_spec(rope_theta: float = 50000.0) -> TinySpec:
    """A tiny Llama GGUF with quantized matrices and a working tokenizer and chat template."""
    return with_tiny_tokenizer(TinySpec(tied=False, rope_theta=rope_theta), CHAT_TEMPLATE)


@pytest.fixture
def gguf_source(tmp_path: Path) -> ModelSource:
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    write_gguf(path, tiny_spec())
    return resolve_model(str(path))


@pytest.fixture
def dequantized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the GGUF tensors dequantized during the test."""
    names: list[str] = []
    original = gguf_weights.dequantize_tensor

    def counting(tensor: GGUFTensor) -> torch.Tensor:
        names.append(tensor.name)
        return original(tensor)

    monkeypatch.setattr(gguf_weights, "dequantize_tensor", counting)
    return names


def load(source: ModelSource, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], WeightOrigin]:
    weights = CachedWeights(source, load_arch_config(source), dtype)
    return dict(weights), weights.origin


def weights_file(source: ModelSource, dtype: torch.dtype) -> Path:
    entry = model_cache_entry(source)
    assert entry is not None
    return entry.weights_path(dtype)


def test_second_load_reads_the_cache_without_dequantizing(
    gguf_source: ModelSource, dequantized: list[str], cache_dir: Path
) -> None:
    first, origin = load(gguf_source, torch.float32)
    assert origin is WeightOrigin.SOURCE_CACHED
    assert len(dequantized) == len(first) > 0
    path = weights_file(gguf_source, torch.float32)
    assert path.parent.parent == cache_dir / "models"
    assert f"-v{FORMAT_VERSION}-{producer_digest()}" in path.parent.name
    assert path.stat().st_mode & 0o777 == 0o600
    dequantized.clear()
    second, origin = load(gguf_source, torch.float32)
    assert origin is WeightOrigin.CACHE
    assert dequantized == []
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_weights_load_bit_identical_parameters(
    gguf_source: ModelSource, dtype: torch.dtype
) -> None:
    arch = load_arch_config(gguf_source)

    def model_from(weights: Any) -> dict[str, torch.Tensor]:
        backend = get_attention_backend(
            "torch_paged",
            dtype,
            torch.device("cpu"),
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        model: LlamaForCausalLM = build_model(arch, 64, dtype, backend)
        model.load_weights(weights)
        return model.state_dict()

    uncached = model_from(iter_weights(gguf_source, arch))  # float32, rounded by copy_
    building = CachedWeights(gguf_source, arch, dtype)
    from_building = model_from(building)
    reading = CachedWeights(gguf_source, arch, dtype)
    from_cache = model_from(reading)
    assert (building.origin, reading.origin) == (WeightOrigin.SOURCE_CACHED, WeightOrigin.CACHE)
    for name, tensor in uncached.items():
        assert tensor.dtype == from_cache[name].dtype
        assert torch.equal(from_building[name], tensor), name
        assert torch.equal(from_cache[name], tensor), name


def test_engine_outputs_are_identical_with_the_cache(
    gguf_source: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversation = [{"role": "user", "content": "The quick brown fox"}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run() -> tuple[list[int], list[Any], str]:
        # The cache holds dequantized weights: only a load that dequantizes uses it.
        llm = LLM(
            str(gguf_source.path),
            dtype="float32",
            block_size=4,
            num_blocks=64,
            quantization="none",
        )
        output = llm.chat(conversation, params, use_tqdm=False)[0]
        completion = output.outputs[0]
        return completion.token_ids, completion.logprobs or [], completion.text

    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "0")
    uncached = run()
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "1")
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_DIR", raising=False)
    building = run()
    reading = run()
    assert building == uncached
    assert reading == uncached


def test_a_load_that_keeps_quantized_tensors_reads_the_gguf_and_writes_no_cache(
    gguf_source: ModelSource,
) -> None:
    arch = load_arch_config(gguf_source)
    weights = CachedWeights(gguf_source, arch, torch.float32, keep_quantized=True)
    tensors = dict(weights)
    assert weights.origin is WeightOrigin.SOURCE
    entry = model_cache_entry(gguf_source)
    assert entry is not None and not entry.weights_path(torch.float32).exists()
    # The tiny file's quantized matrices (the embedding's too: the model dequantizes
    # what it cannot take) come in their blocks; norms and float matrices as tensors.
    kept = {name for name, t in tensors.items() if isinstance(t, QuantizedTensor)}
    assert any("self_attn" in name for name in kept) and any("mlp" in name for name in kept)
    assert not any("norm" in name for name in kept)
    assert len(kept) < len(tensors)
    # A later dequantizing load builds the cache from the file as before.
    building = CachedWeights(gguf_source, arch, torch.float32)
    dequantized = dict(building)
    assert building.origin is WeightOrigin.SOURCE_CACHED
    for name in kept:
        quantized = tensors[name]
        assert isinstance(quantized, QuantizedTensor)
        assert torch.equal(quantized.dequantize(), dequantized[name]), name


def test_config_and_tokenizer_are_read_back_without_the_gguf(
    gguf_source: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch = load_arch_config(gguf_source)
    tokenizer = load_tokenizer(gguf_source)

    def must_not_run(*args: object) -> None:
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr("kvserve.loader.load_gguf_arch_config", must_not_run)
    monkeypatch.setattr(tokenizer_module, "_build_tokenizer", must_not_run)
    assert load_arch_config(gguf_source) == arch
    cached = load_tokenizer(gguf_source)
    assert type(cached) is type(tokenizer)
    assert cached.get_vocab() == tokenizer.get_vocab()
    text = "Numbers like 12 and symbols #$% in the quick brown fox"
    assert cached.encode(text) == tokenizer.encode(text)
    assert (cached.bos_token, cached.eos_token) == (tokenizer.bos_token, tokenizer.eos_token)
    assert cached.chat_template == tokenizer.chat_template == CHAT_TEMPLATE
    conversation = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(conversation, tokenize=False) == (
        tokenizer.apply_chat_template(conversation, tokenize=False)
    )


def test_a_changed_source_gets_a_new_entry(
    gguf_source: ModelSource, dequantized: list[str]
) -> None:
    """Rewritten in place with the same size and modification time: its bytes still count."""
    before, _ = load(gguf_source, torch.float32)
    old_entry = model_cache_entry(gguf_source)
    path = gguf_source.path
    info = path.stat()
    with path.open("r+b") as file:  # the last bytes are a float32 tensor's
        file.seek(-4, os.SEEK_END)
        file.write(bytes(4))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert path.stat().st_size == info.st_size
    dequantized.clear()
    after, origin = load(gguf_source, torch.float32)
    assert origin is WeightOrigin.SOURCE_CACHED and dequantized
    assert model_cache_entry(gguf_source) != old_entry
    fresh = dict(iter_weights(gguf_source, load_arch_config(gguf_source)))
    changed = [name for name in fresh if not torch.equal(before[name], fresh[name])]
    assert changed
    for name, tensor in fresh.items():
        assert torch.equal(after[name], tensor), name


def test_a_changed_loader_gets_a_new_entry(
    gguf_source: ModelSource, dequantized: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As if kvserve's loader (or gguf, transformers) changed since the entry was written."""
    load(gguf_source, torch.float32)
    old_entry = model_cache_entry(gguf_source)
    monkeypatch.setattr(model_cache, "producer_digest", lambda: "0" * 12)
    dequantized.clear()
    _, origin = load(gguf_source, torch.float32)
    assert origin is WeightOrigin.SOURCE_CACHED and dequantized
    assert model_cache_entry(gguf_source) != old_entry


def test_an_unchanged_file_is_hashed_once_and_a_touched_one_keeps_its_entry(
    gguf_source: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[Path] = []
    original = source_digest.sha256_of_file

    def counting(path: Path) -> str:
        hashed.append(path)
        return original(path)

    monkeypatch.setattr(source_digest, "sha256_of_file", counting)
    load(gguf_source, torch.float32)
    assert hashed == [gguf_source.path]
    load(gguf_source, torch.float32)
    assert hashed == [gguf_source.path]  # the stamp answered
    os.utime(gguf_source.path)  # e.g. a reinstall of the same file
    _, origin = load(gguf_source, torch.float32)
    assert len(hashed) == 2
    assert origin is WeightOrigin.CACHE


def rebuilds_with_warning(
    source: ModelSource, dequantized: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The weights load from the source, with a warning, and a good cache file replaces the bad."""
    reference = dict(iter_weights(source, load_arch_config(source)))
    dequantized.clear()
    with caplog.at_level(logging.WARNING):
        weights, origin = load(source, torch.float32)
    assert "rebuilding" in caplog.text and "weights-float32.safetensors" in caplog.text
    assert origin is WeightOrigin.SOURCE_CACHED and dequantized
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name
    _, origin = load(source, torch.float32)
    assert origin is WeightOrigin.CACHE


def test_a_cache_file_others_can_write_is_rebuilt(
    gguf_source: ModelSource, dequantized: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    load(gguf_source, torch.float32)
    weights_file(gguf_source, torch.float32).chmod(0o666)
    rebuilds_with_warning(gguf_source, dequantized, caplog)
    assert "group or others write" in caplog.text
    assert weights_file(gguf_source, torch.float32).stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_cache_file_of_another_user_is_rebuilt(
    gguf_source: ModelSource, dequantized: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    load(gguf_source, torch.float32)
    os.chown(weights_file(gguf_source, torch.float32), OTHER_UID, OTHER_UID)
    rebuilds_with_warning(gguf_source, dequantized, caplog)
    assert f"owned by uid {OTHER_UID}" in caplog.text
    assert weights_file(gguf_source, torch.float32).stat().st_uid == os.geteuid()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other dtype"])
def test_a_damaged_cache_file_is_rebuilt(
    gguf_source: ModelSource,
    dequantized: list[str],
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    load(gguf_source, torch.float32)
    path = weights_file(gguf_source, torch.float32)
    if damage == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif damage == "garbage":
        path.write_bytes(b"\xff" * 64)
    else:  # a valid file written for another dtype, renamed by hand
        load(gguf_source, torch.bfloat16)
        weights_file(gguf_source, torch.bfloat16).replace(path)
    rebuilds_with_warning(gguf_source, dequantized, caplog)


def test_an_untrusted_tokenizer_folder_is_rebuilt(
    gguf_source: ModelSource, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = load_tokenizer(gguf_source)
    entry = model_cache_entry(gguf_source)
    assert entry is not None
    (entry.tokenizer_folder / "tokenizer.json").chmod(0o666)
    with caplog.at_level(logging.WARNING):
        rebuilt = load_tokenizer(gguf_source)
    assert "tokenizer.json" in caplog.text and "group or others write" in caplog.text
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    assert (entry.tokenizer_folder / "tokenizer.json").stat().st_mode & 0o022 == 0


def test_the_cache_can_be_switched_off(
    gguf_source: ModelSource,
    dequantized: list[str],
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE", "0")
    for _ in range(2):
        dequantized.clear()
        weights, origin = load(gguf_source, torch.float32)
        assert origin is WeightOrigin.SOURCE and len(dequantized) == len(weights)
    load_tokenizer(gguf_source)
    assert not cache_dir.exists()


def test_entries_can_live_in_a_folder_of_their_own(
    gguf_source: ModelSource,
    dequantized: list[str],
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = tmp_path / "converted"
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_DIR", str(folder))
    _, origin = load(gguf_source, torch.float32)
    assert origin is WeightOrigin.SOURCE_CACHED
    dequantized.clear()
    _, origin = load(gguf_source, torch.float32)
    assert origin is WeightOrigin.CACHE and dequantized == []
    assert weights_file(gguf_source, torch.float32).parent.parent == folder
    assert folder.stat().st_mode & 0o777 == 0o700
    assert not (cache_dir / "models").exists()
    folder.chmod(0o777)  # the same checks as the cache's own folder
    _, origin = load(gguf_source, torch.float32)
    assert origin is WeightOrigin.SOURCE


def test_an_unusable_cache_folder_means_no_cache_not_an_error(
    gguf_source: ModelSource, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir.mkdir(mode=0o700)
    cache_dir.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        _, origin = load(gguf_source, torch.float32)  # config and weights
        load_tokenizer(gguf_source)
    assert origin is WeightOrigin.SOURCE
    assert [r.getMessage() for r in caplog.records if "not used" in r.getMessage()] == [
        f"the converted-model cache is not used for {gguf_source.path}: cache folder "
        f"{cache_dir} is not used: its mode drwxrwxrwx lets group or others write to it"
    ]
    assert list(cache_dir.iterdir()) == []


def test_hugging_face_folders_are_read_in_place(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from model_fixtures import save_tiny_model

    folder = save_tiny_model(tmp_path / "hf", "llama", train_tiny_tokenizer())
    source = resolve_model(str(folder))
    weights, origin = load(source, torch.bfloat16)
    assert origin is WeightOrigin.SOURCE
    stored = dict(iter_weights(source, load_arch_config(source)))
    assert weights.keys() == stored.keys()
    assert all(torch.equal(weights[n], t) for n, t in stored.items())
    load_tokenizer(source)
    assert not cache_dir.exists()
