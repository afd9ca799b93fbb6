"""The BF16 GGUF the llama.cpp baseline runs: same tensors rounded to bf16, same metadata, cached."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve.benchmarks.baselines.llamacpp_weights import (
    bf16_gguf_path,
    llamacpp_model_file,
    write_bf16_gguf,
)
from kvserve.errors import ModelLoadError
from kvserve.loader import ModelSource, resolve_model

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, VOCAB = 64, 128, 40
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def write_source_gguf(path: Path, seed: int = 0) -> None:
    """A small llama-shaped GGUF: quantized matrices, F32 norms, a tokenizer, a chat template."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    # Token texts that are not plain ASCII must survive byte for byte.
    writer.add_token_list([f"tok{i}" for i in range(VOCAB - 2)] + ["Ġé", "\u2581日本"])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    tensors = {
        "token_embd.weight": ((VOCAB, HIDDEN), Q.Q8_0),
        "blk.0.attn_norm.weight": ((HIDDEN,), Q.F32),
        "blk.0.attn_q.weight": ((HIDDEN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_up.weight": ((FFN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_down.weight": ((HIDDEN, FFN), Q.F16),
        "blk.0.attn_output.weight": ((HIDDEN, HIDDEN), Q.F32),
        "output_norm.weight": ((HIDDEN,), Q.F32),
    }
    for name, (shape, qtype) in tensors.items():
        values = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def field_values(reader: gguf.GGUFReader) -> dict[str, object]:
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def dequantized(tensor: gguf.ReaderTensor) -> np.ndarray:
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def test_bf16_copy_holds_the_rounded_tensors_and_every_metadata_key(tmp_path: Path) -> None:
    source_path, copy_path = tmp_path / "source.gguf", tmp_path / "copy.bf16.gguf"
    write_source_gguf(source_path)
    write_bf16_gguf(source_path, copy_path)
    source, copy = gguf.GGUFReader(source_path), gguf.GGUFReader(copy_path)

    source_fields, copy_fields = field_values(source), field_values(copy)
    assert set(copy_fields) == set(source_fields)
    for name, value in source_fields.items():
        if name != "general.file_type":
            assert copy_fields[name] == value, name
    assert copy_fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    assert copy_fields["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert copy_fields["tokenizer.ggml.tokens"][-2:] == ["Ġé", "\u2581日本"]

    assert [t.name for t in copy.tensors] == [t.name for t in source.tensors]
    for original, written in zip(source.tensors, copy.tensors, strict=True):
        values = torch.from_numpy(dequantized(original).astype(np.float32))
        if len(original.shape) == 1:
            assert written.tensor_type == Q.F32, written.name
            expected = values
        else:
            assert written.tensor_type == Q.BF16, written.name
            expected = values.to(torch.bfloat16).float()
        read_back = torch.from_numpy(dequantized(written).astype(np.float32))
        assert read_back.shape == expected.shape, written.name
        assert torch.equal(read_back, expected), written.name
        # bf16 keeps 8 bits of mantissa: close to the source, but not the same numbers.
        if written.tensor_type == Q.BF16:
            assert not torch.equal(read_back, values), written.name
            torch.testing.assert_close(read_back, values, rtol=2**-8, atol=0)


def test_the_copy_is_cached_by_the_source_contents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source_path = tmp_path / "model.gguf"
    write_source_gguf(source_path)
    source = resolve_model(str(source_path))

    first = llamacpp_model_file(source, "bf16")
    assert first.parent == tmp_path / "cache" / "llamacpp"
    assert first == bf16_gguf_path(source_path)
    assert list(first.parent.iterdir()) == [first]  # no temporary file left behind
    written_at = first.stat().st_mtime_ns
    assert llamacpp_model_file(source, "bf16") == first
    assert first.stat().st_mtime_ns == written_at  # served from the cache, not rewritten

    # Other weights under the same name get another copy.
    write_source_gguf(source_path, seed=1)
    assert llamacpp_model_file(source, "bf16") != first
    assert llamacpp_model_file(source, "source") == source_path


def test_a_hugging_face_folder_has_no_gguf_for_llama_cpp(tmp_path: Path) -> None:
    folder = ModelSource(kind="hf", path=tmp_path, name="some/model")
    with pytest.raises(ModelLoadError, match="needs a GGUF model"):
        llamacpp_model_file(folder, "bf16")
