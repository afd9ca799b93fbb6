"""The bench's random-weight GGUF models: what kvserve's loader reads back, and the cache.

llama.cpp's ``llama-quantize`` is stood in for by a small script (the real one
comes from ``make bench-deps``, minutes of compiling).
"""

from __future__ import annotations

import stat
from pathlib import Path

import gguf
import pytest
import torch

from kvserve.benchmarks.baselines import llamacpp_tools
from kvserve.benchmarks.baselines.llamacpp_tools import ToolBuild
from kvserve.benchmarks.workloads.shaped_gguf import (
    shaped_gguf,
    shaped_gguf_path,
    write_shaped_gguf,
)
from kvserve.benchmarks.workloads.shaped_models import INIT_STD, SHAPES, TOKENIZER_MODEL, main
from kvserve.errors import InvalidParameterError
from kvserve.loader import resolve_model
from kvserve.loader.gguf_config import load_gguf_arch_config
from kvserve.loader.gguf_weights import iter_gguf_weights
from kvserve.loader.tokenizer import load_tokenizer

TINY = "tiny-llama"
Q = gguf.GGMLQuantizationType


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shaped") / "tiny.gguf"
    write_shaped_gguf(TINY, path, seed=0)
    return path


def test_kvserve_reads_the_shape_back_from_the_gguf(tiny_gguf: Path) -> None:
    config = SHAPES[TINY].config
    arch = load_gguf_arch_config(tiny_gguf)
    assert arch.architecture == "llama"
    assert (arch.hidden_size, arch.num_hidden_layers, arch.intermediate_size) == (64, 2, 128)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 16)
    assert arch.vocab_size == config["vocab_size"] == 49152
    assert arch.max_position_embeddings == config["max_position_embeddings"]
    assert arch.rope_theta == config["rope_theta"]
    assert arch.rms_norm_eps == pytest.approx(config["rms_norm_eps"])
    assert arch.tie_word_embeddings
    assert arch.bos_token_id == config["bos_token_id"]
    assert config["eos_token_id"] in arch.eos_token_ids


def test_the_gguf_holds_the_hugging_face_tensors_in_bf16_and_f32(tiny_gguf: Path) -> None:
    weights = dict(iter_gguf_weights(tiny_gguf, load_gguf_arch_config(tiny_gguf)))
    # The reference: the names and shapes transformers' own llama class holds.
    assert {name: tuple(w.shape) for name, w in weights.items()} == dict(SHAPES[TINY].tensors())
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tiny_gguf).tensors}
    assert types["token_embd.weight"] == Q.BF16 and types["blk.1.ffn_down.weight"] == Q.BF16
    assert types["blk.0.attn_norm.weight"] == Q.F32 and types["output_norm.weight"] == Q.F32
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    # The first tensor drawn is the embedding: the seed's first normal numbers, rounded to bf16.
    expected = torch.randn((49152, 64), generator=torch.Generator().manual_seed(0)) * INIT_STD
    assert torch.equal(weights["model.embed_tokens.weight"], expected.bfloat16().float())


def test_the_gguf_carries_smollm2s_tokenizer(tiny_gguf: Path) -> None:
    ours = gguf.GGUFReader(tiny_gguf).fields
    smollm2 = gguf.GGUFReader(resolve_model(TOKENIZER_MODEL).path).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert ours[key].contents() == smollm2[key].contents()
    text = "The quick brown fox jumps over the lazy dog."
    tokenizer = load_tokenizer(resolve_model(str(tiny_gguf)))
    assert tokenizer.encode(text) == load_tokenizer(resolve_model(TOKENIZER_MODEL)).encode(text)


def fake_quantize(folder: Path, exit_code: int = 0) -> ToolBuild:
    """A ``llama-quantize`` that checks its type argument and copies its input, tagged."""
    script = folder / "llama-quantize"
    script.write_text(
        "#!/bin/sh\n"
        f"[ {exit_code} -eq 0 ] || {{ echo 'quantize broke' >&2; exit {exit_code}; }}\n"
        'case "$3" in Q8_0|Q4_K_M) ;; *) echo "bad type $3" >&2; exit 3;; esac\n'
        'cat "$1" > "$2"; printf "%s" "$3" >> "$2"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return ToolBuild(folder, "avx2")


@pytest.mark.parametrize(("gguf_type", "quant_name"), [("q8_0", b"Q8_0"), ("q4_k_m", b"Q4_K_M")])
def test_a_quantized_type_is_the_bf16_file_through_llama_quantize_cached(
    gguf_type: str, quant_name: bytes, cache: Path, tmp_path: Path
) -> None:
    build = fake_quantize(tmp_path)
    path = shaped_gguf(TINY, gguf_type, build=build)
    bf16 = shaped_gguf_path(TINY, "bf16")
    assert path == shaped_gguf_path(TINY, gguf_type) and path.is_relative_to(cache)
    assert path.read_bytes() == bf16.read_bytes() + quant_name
    # Cached: a broken tool is not run again, and the BF16 file is not rewritten.
    bf16_written = bf16.stat().st_mtime_ns
    assert shaped_gguf(TINY, gguf_type, build=fake_quantize(tmp_path, exit_code=1)) == path
    assert shaped_gguf(TINY, "bf16") == bf16 and bf16.stat().st_mtime_ns == bf16_written


def test_a_failing_llama_quantize_leaves_no_file(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"llama-quantize failed .*quantize broke"):
        shaped_gguf(TINY, "q8_0", build=fake_quantize(tmp_path, exit_code=1))
    folder = shaped_gguf_path(TINY, "q8_0").parent
    assert sorted(p.name for p in folder.glob("*.gguf*")) == ["tiny-llama.bf16.gguf"]


def test_without_llama_cpps_tools_nothing_is_written(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llamacpp_tools, "tools_dir", lambda level: tmp_path / "none" / level)
    with pytest.raises(InvalidParameterError, match="make bench-deps"):
        shaped_gguf(TINY, "q4_k_m")
    assert not list(cache.rglob("*.gguf"))


def test_the_command_prints_the_path_and_refuses_what_it_cannot_write(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([TINY, "--gguf", "bf16"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(shaped_gguf_path(TINY, "bf16"))
    assert main(["gpt2-124m", "--gguf", "bf16"]) == 2
    assert "shape must be one of ['smollm2-1.7b', 'tiny-llama']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="gguf_type must be one of"):
        shaped_gguf(TINY, "q2_k")
