"""Decoders as embedders (``task="embed"``): last-token and mean pooling against transformers,
and embedding requests batched beside generation in one engine.

The reference is transformers' own model on the same tiny random checkpoint:
its last hidden state (final norm applied), pooled here in float64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidParameterError

PROMPTS = [
    [5, 17, 42, 9, 33, 71, 2],
    [8, 3],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 4],
    [7],
]


def _reference(folder: Path, prompts: list[list[int]], pooling: str) -> torch.Tensor:
    model = AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    vectors = []
    for ids in prompts:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0].double()
        vectors.append(hidden[-1] if pooling == "last" else hidden.mean(0))
    return F.normalize(torch.stack(vectors), dim=-1)


def _embed(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outputs], dtype=torch.float64)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_pooling_matches_transformers(tiny_model_dir: Path, pooling: str) -> None:
    llm = LLM(
        str(tiny_model_dir), dtype="float32", task="embed", pooling_type=pooling, num_blocks=64
    )
    vectors = _embed(llm, PROMPTS)
    cosine = F.cosine_similarity(vectors, _reference(tiny_model_dir, PROMPTS, pooling), dim=-1)
    assert cosine.min().item() >= 0.9999, cosine
    alone = torch.cat([_embed(llm, [p]) for p in PROMPTS])
    assert torch.allclose(vectors, alone, atol=1e-5)
    # Nothing of the embedding requests stays in the pool or the prefix cache.
    manager = llm.llm_engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_embedding_requests_run_beside_decodes(tiny_model_dir: Path) -> None:
    """The same step decodes streams and computes embeddings; neither changes the other."""
    llm = LLM(str(tiny_model_dir), dtype="float32", task="embed", num_blocks=128)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    generated_alone = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], greedy)]
    embeddings_alone = _embed(llm, PROMPTS)

    steps: list[set[str]] = []
    execute = engine.runner.execute

    def recording(scheduler_output: Any) -> Any:
        steps.append({item.request.request_id for item in scheduler_output.scheduled})
        return execute(scheduler_output)

    engine.runner.execute = recording  # type: ignore[method-assign]
    engine.add_request("gen-0", "a b c", greedy)
    engine.add_request("gen-1", "d e", greedy)
    for _ in range(3):
        engine.step()  # both streams are decoding now
    from kvserve.pooling_params import PoolingParams

    for index, prompt in enumerate(PROMPTS):
        engine.add_request(
            f"emb-{index}", {"prompt_token_ids": prompt}, pooling_params=PoolingParams()
        )
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    mixed = [s for s in steps if "gen-0" in s and any(i.startswith("emb-") for i in s)]
    assert mixed and all(f"emb-{i}" in mixed[0] for i in range(len(PROMPTS)))
    assert [finished[f"gen-{i}"].outputs[0].token_ids for i in range(2)] == generated_alone
    vectors = torch.tensor([finished[f"emb-{i}"].embedding for i in range(len(PROMPTS))])
    assert torch.allclose(vectors.double(), embeddings_alone, atol=1e-5)
    assert all(finished[f"emb-{i}"].outputs[0].token_ids == [] for i in range(len(PROMPTS)))


def test_decoder_without_embed_task_refuses_embeddings(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", num_blocks=64)
    with pytest.raises(InvalidParameterError) as refused:
        llm.embed("hello", use_tqdm=False)
    assert refused.value.param == "model" and "embed" in refused.value.message


def test_bad_task_and_pooling_type_name_themselves(tiny_model_dir: Path) -> None:
    with pytest.raises(InvalidParameterError) as task:
        LLM(str(tiny_model_dir), task="classify")
    assert task.value.param == "task"
    with pytest.raises(InvalidParameterError) as pooling:
        LLM(str(tiny_model_dir), task="embed", pooling_type="max")
    assert pooling.value.param == "pooling_type"
