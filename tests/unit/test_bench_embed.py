"""``kvserve bench embed``'s pieces that need no measurement: its workload, its table, and the
names of the GGUF it writes for llama-server."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from kvserve.benchmarks.baselines.bert_gguf import _gguf_name
from kvserve.benchmarks.offline.embed import embed_table
from kvserve.benchmarks.workloads.sentences import embedding_sentences
from kvserve.loader import resolve_model


def test_sentences_are_seeded_and_within_the_word_range() -> None:
    sentences = embedding_sentences(200, 10, 60, seed=3)
    assert sentences == embedding_sentences(200, 10, 60, seed=3)
    assert sentences != embedding_sentences(200, 10, 60, seed=4)
    counts = [len(s.split()) for s in sentences]
    assert min(counts) >= 10 and max(counts) <= 60 and len(set(counts)) > 20
    with pytest.raises(ValueError):
        embedding_sentences(1, 0, 5, seed=0)


def test_table_states_kvserves_speedup_over_each_baseline() -> None:
    table = embed_table(
        {
            "kvserve": {"sentences_per_s": 300.0, "seconds": 1.0},
            "sentence-transformers": {
                "sentences_per_s": 100.0,
                "seconds": 3.0,
                "min_cosine": 0.9999,
            },
        }
    ).render()
    assert "3.00x vs sentence-transformers" in table and "0.99990" in table


@pytest.mark.slow
def test_every_weight_of_the_shipped_model_has_a_gguf_name() -> None:
    folder = resolve_model("all-minilm-l6-v2").path
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = {name: _gguf_name(name) for name in weights.keys()}  # noqa: SIM118
    unmapped = {name for name, gguf in names.items() if gguf is None}
    # Only what llama.cpp does not read: the position-ids buffer and BertModel's pooler.
    assert unmapped <= {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}
    mapped = {gguf for gguf in names.values() if gguf is not None}
    assert len(mapped) == len(names) - len(unmapped)  # no two tensors under one name
    assert names["encoder.layer.5.attention.self.query.bias"] == "blk.5.attn_q.bias"
    assert names["embeddings.token_type_embeddings.weight"] == "token_types.weight"
