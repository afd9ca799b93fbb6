"""A GGUF file of a BERT sentence-embedding folder, for llama-server ``--embeddings``.

llama.cpp reads BERT as architecture ``bert``: the same tensors under its
own names, the WordPiece vocabulary rewritten to its "phantom space" form
(a word-start piece gets ``\u2581`` in front, a ``##`` continuation loses the
``##``, bracketed specials stay), and the pooling as metadata. The file is
written with the ``gguf`` package (float32, as the folder stores the model)
into kvserve's cache, once per folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.errors import InvalidParameterError
from kvserve.private_cache import atomic_target, private_cache_dir

# llama.cpp's pooling enum (LLAMA_POOLING_TYPE_*).
_POOLING = {"mean": 1, "cls": 2, "last": 3}
# Hugging Face BertModel names → llama.cpp's, per layer ("{}" is the layer index).
_LAYER_TENSORS = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_TOP_TENSORS = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}


def bert_gguf(folder: Path, pooling_type: str) -> Path:
    """The GGUF of ``folder`` in kvserve's cache, written on first use."""
    try:
        import gguf
    except ImportError as exc:
        raise InvalidParameterError(
            "baselines", "llama-server needs a GGUF written by the gguf package: pip install gguf"
        ) from exc
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    target = private_cache_dir("embed-gguf") / f"bert-{digest}-{pooling_type}.gguf"
    if target.exists():
        return target
    with atomic_target(target, ".gguf") as part:
        writer: Any = gguf.GGUFWriter(str(part), "bert")
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_layer_norm_eps(config.get("layer_norm_eps", 1e-12))
        writer.add_causal_attention(False)
        writer.add_pooling_type(gguf.PoolingType(_POOLING[pooling_type]))
        _add_vocab(writer, folder, gguf)
        for name, tensor in sorted(load_file(folder / "model.safetensors").items()):
            gguf_name = _gguf_name(name.removeprefix("bert."))
            if gguf_name is not None:
                writer.add_tensor(gguf_name, np.ascontiguousarray(tensor, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return target


def _gguf_name(name: str) -> str | None:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    parts = name.split(".")
    if parts[:2] != ["encoder", "layer"]:
        return None  # the pooler, the position ids buffer
    module, kind = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{_LAYER_TENSORS[module]}.{kind}"


def _add_vocab(writer: Any, folder: Path, gguf: Any) -> None:
    """The WordPiece vocabulary as llama.cpp's ``bert`` tokenizer reads it: [CLS] opens a
    text (its BOS) and [SEP] closes it."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = [""] * len(vocab)
    for piece, index in vocab.items():
        tokens[index] = piece
    special = {t["content"] for t in tokenizer.get("added_tokens", [])}

    def phantom(piece: str) -> str:
        if piece.startswith("[") and piece.endswith("]"):
            return piece
        return piece[2:] if piece.startswith("##") else "\u2581" + piece

    types = [
        gguf.TokenType.CONTROL if piece in special else gguf.TokenType.NORMAL for piece in tokens
    ]
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(piece) for piece in tokens])
    writer.add_token_types(types)
    writer.add_token_type_count(2)  # segments A and B: BERT's token_types table
    writer.add_bos_token_id(vocab["[CLS]"])
    writer.add_eos_token_id(vocab["[SEP]"])
    writer.add_sep_token_id(vocab["[SEP]"])
    writer.add_unk_token_id(vocab["[UNK]"])
    writer.add_pad_token_id(vocab["[PAD]"])
    writer.add_mask_token_id(vocab["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)
