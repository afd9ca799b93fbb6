"""The engine on a GPU: FlexAttention matches the PyTorch backend, and CUDA-graph replay matches eager.

Skipped without a CUDA device. Tiny Llama and Qwen2 in float32 on CUDA: the
same greedy requests through the PyTorch backend, FlexAttention run eagerly
(``enforce_eager``) and FlexAttention with decode steps replayed as CUDA
graphs must give the same tokens, through preemption; the graphed run must
have replayed graphs of more than one batch-size bucket.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.cuda_graphs import DecodeGraphs
from model_fixtures import save_tiny_model, train_tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

KINDS = ("llama", "qwen2")
ENGINE_ARGS = dict(
    device="cuda",
    dtype="float32",
    block_size=16,
    num_blocks=12,  # 11 usable blocks of 16 tokens: six ~45-token sequences preempt
    max_num_batched_tokens=128,
    max_num_seqs=8,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tiny_tokenizer()
    return {kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer) for kind in KINDS}


def greedy_tokens(model_dir: Path, **engine_args: object) -> tuple[list[list[int]], LLM]:
    rng = random.Random(3)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(5, 30))]}
        for _ in range(6)
    ]
    llm = LLM(str(model_dir), **ENGINE_ARGS, **engine_args)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("kind", KINDS)
def test_flex_on_the_gpu_gives_the_pytorch_backends_tokens(
    model_dirs: dict[str, Path], kind: str
) -> None:
    reference, llm = greedy_tokens(model_dirs[kind], attention_backend="torch_paged")
    assert llm.llm_engine.runner.kv_cache.is_cuda
    flex, llm = greedy_tokens(model_dirs[kind], attention_backend="flex", enforce_eager=True)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert flex == reference


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replay_gives_the_eager_tokens(
    model_dirs: dict[str, Path], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, _ = greedy_tokens(model_dirs[kind], attention_backend="flex", enforce_eager=True)
    replayed_buckets: set[int] = set()
    run = DecodeGraphs.run

    def counting(self: DecodeGraphs, input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        replayed_buckets.add(next(b for b in self.buckets if b >= input_ids.shape[0]))
        return run(self, input_ids, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGraphs, "run", counting)
    graphed, llm = greedy_tokens(model_dirs[kind])  # auto: flex with graphs on CUDA
    assert llm.llm_engine.runner.decode_graphs is not None
    assert len(replayed_buckets) > 1
    assert graphed == eager
