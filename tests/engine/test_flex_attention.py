"""FlexAttention over the page pool gives what the PyTorch backend gives.

Tiny Llama and Qwen2 models in float32, one engine per backend. A mixed step
(two decodes and a chunk that all continue from a shared 2-block prefix, and
a fresh prompt) on random pages, over the same cached K/V, must give logits
within 1e-4; whole runs through a pool small enough to preempt must give the
same greedy tokens. Attention alone is compared on hand-built layouts with
a sliding window and soft-capped scores. The CUDA-graph path's buffers are
run on CPU too, each replay an eager forward over them.

FlexAttention compiles on first use (seconds per shape on CPU): every engine
here has the same pool size and head shapes, and steps stay under 64 tokens,
so the module compiles a few shapes once.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import FlexAttention, FlexMetadata, PrefillChunk, TorchPagedAttention
from kvserve.attention.flex_compile import COMPILE_STATS
from kvserve.attention.metadata import AttentionLayout
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.engine import LLMEngine
from kvserve.sampling_params import SamplingParams as Params
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.input_batch import prepare_inputs
from model_fixtures import save_tiny_model, train_tiny_tokenizer

KINDS = ("llama", "qwen2")
BLOCK_SIZE = 4
NUM_BLOCKS = 25  # small enough that the greedy runs below preempt
ENGINE_ARGS = dict(
    dtype="float32",
    block_size=BLOCK_SIZE,
    num_blocks=NUM_BLOCKS,
    max_num_batched_tokens=64,
    max_num_seqs=8,
)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tiny_tokenizer()
    return {kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer) for kind in KINDS}


def scheduled(tokens: list[int], computed: int, table: list[int]) -> ScheduledRequest:
    request = Request(f"r{len(tokens)}-{computed}", tokens, Params())
    request.num_computed_tokens = computed
    return ScheduledRequest(request, len(tokens) - computed, (table,), True)


def run_step(engine: LLMEngine, items: list[ScheduledRequest]) -> torch.Tensor:
    """Every row's logits ``[T, V]`` for one step through the engine's model and pool."""
    runner = engine.runner
    with torch.inference_mode():
        inputs = prepare_inputs(items, BLOCK_SIZE, runner.device, runner.sliding_windows)
        return runner.model.compute_logits(runner.forward(inputs))


@pytest.mark.parametrize("kind", KINDS)
def test_a_mixed_step_over_shared_prefix_pages_matches_the_pytorch_backend(
    model_dirs: dict[str, Path], kind: str
) -> None:
    reference = LLMEngine.from_engine_args(
        str(model_dirs[kind]), attention_backend="torch_paged", **ENGINE_ARGS
    )
    flex = LLMEngine.from_engine_args(
        str(model_dirs[kind]), attention_backend="flex", **ENGINE_ARGS
    )
    assert isinstance(flex.runner.attention_backend, FlexAttention)
    rng = random.Random(kind)
    pages = rng.sample(range(1, NUM_BLOCKS), 11)
    prefix = pages[:2]  # blocks 0-1 of A, B and C: the same 8 tokens
    table_a, table_b, table_c = prefix + pages[2:3], prefix + pages[3:5], prefix + pages[5:7]
    table_d = pages[7:9]
    shared = [rng.randrange(3, 300) for _ in range(8)]
    tokens_a = shared + [rng.randrange(3, 300) for _ in range(4)]
    tokens_b = shared + [rng.randrange(3, 300) for _ in range(6)]
    tokens_c = shared + [rng.randrange(3, 300) for _ in range(7)]
    tokens_d = [rng.randrange(3, 300) for _ in range(7)]
    # Cache the contexts through the reference (A's prefill writes the shared prefix first).
    run_step(reference, [scheduled(tokens_a[:11], 0, table_a)])
    run_step(reference, [scheduled(tokens_b[:13], 8, table_b), scheduled(tokens_c[:9], 8, table_c)])
    flex.runner.kv_cache.copy_(reference.runner.kv_cache)

    mixed = [
        scheduled(tokens_a, 11, table_a),  # decode at 11
        scheduled(tokens_b, 13, table_b),  # decode at 13
        scheduled(tokens_c, 9, table_c),  # a 6-token chunk after 9 cached tokens
        scheduled(tokens_d, 0, table_d),  # a fresh 7-token prompt
    ]
    expected = run_step(reference, mixed)
    actual = run_step(flex, mixed)
    assert actual.shape == expected.shape == (1 + 1 + 6 + 7, expected.shape[1])
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)


def test_greedy_outputs_through_preemption_match_the_pytorch_backend(
    model_dirs: dict[str, Path],
) -> None:
    rng = random.Random(7)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(5, 30))]}
        for _ in range(6)
    ]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for kind in KINDS:
        runs = {}
        for backend in ("torch_paged", "flex"):
            llm = LLM(str(model_dirs[kind]), attention_backend=backend, **ENGINE_ARGS)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs[backend] = [o.outputs[0].token_ids for o in outputs]
            assert llm.llm_engine.scheduler.num_preemptions_total > 0
        assert runs["flex"] == runs["torch_paged"], kind
    assert 0 < COMPILE_STATS.compiles <= 8  # row buckets x variants, not one per step


@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (5, 2.0)])
def test_windows_and_soft_caps_match_the_pytorch_backend(
    window: int | None, soft_cap: float | None
) -> None:
    torch.manual_seed(0)
    pool = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16)
    pool[:, 0] = 0  # the null block reads as zeros
    # Decodes at 6 (pages 3 5) and 8 (pages 3 6 7); a fresh prompt; a chunk after 6 tokens.
    layout = AttentionLayout(
        slot_mapping=torch.tensor([22, 28, 40, 41, 42, 43, 44, 50, 51, 52]),
        num_decode_tokens=2,
        decode_block_tables=torch.tensor([[3, 5, 0], [3, 6, 7]]),
        decode_seq_lens=torch.tensor([7, 9]),
        prefills=(
            PrefillChunk(2, 5, 0, torch.tensor([10, 11])),
            PrefillChunk(7, 3, 6, torch.tensor([3, 12, 13])),
        ),
        block_size=BLOCK_SIZE,
        sliding_window=window,
    )
    query, key, value = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    assert_flex_matches_the_pytorch_backend(
        FlexAttention(CPU, max_blocks_per_seq=8), layout, pool, query, key, value, soft_cap
    )


def assert_flex_matches_the_pytorch_backend(
    flex: FlexAttention,
    layout: AttentionLayout,
    pool: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    soft_cap: float | None,
) -> FlexMetadata:
    """One layer's attention of ``layout`` through ``flex`` and the PyTorch backend, each on
    its own copy of ``pool``: the outputs and the written pools agree. Returns flex's metadata."""
    metadata = flex.build_group(layout, query.dtype, NUM_BLOCKS)
    flex_pool, reference_pool = pool.clone(), pool.clone()
    actual = flex.forward(query, key, value, flex_pool, metadata, 0.25, soft_cap)
    reference = TorchPagedAttention()
    expected = reference.forward(
        query,
        key,
        value,
        reference_pool,
        reference.build_group(layout, query.dtype, NUM_BLOCKS),
        0.25,
        soft_cap,
    )
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    assert torch.equal(flex_pool, reference_pool)  # both wrote the step's K/V the same way
    return metadata


@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (5, 2.0)])
def test_the_per_row_decode_form_matches_the_pytorch_backend(
    window: int | None, soft_cap: float | None
) -> None:
    """Decode rows as FlexAttention's batch (the CUDA default, run here on CPU): a request
    verifying two proposals (three rows of one table, each seeing up to its own position),
    a decode past a window, and a row whose table starts with pages the window left."""
    torch.manual_seed(1)
    pool = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16)
    pool[:, 0] = 0
    layout = AttentionLayout(
        slot_mapping=torch.tensor([22, 23, 28, 41, 77]),
        num_decode_tokens=5,
        decode_block_tables=torch.tensor(
            [[3, 5, 0, 0], [3, 5, 0, 0], [3, 5, 7, 0], [9, 8, 10, 0], [14, 15, 16, 19]]
        ),
        decode_seq_lens=torch.tensor([7, 8, 9, 10, 14]),
        prefills=(),
        block_size=BLOCK_SIZE,
        sliding_window=window,
    )
    query, key, value = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    flex = FlexAttention(CPU, max_blocks_per_seq=8, per_row_decode=True)
    metadata = assert_flex_matches_the_pytorch_backend(
        flex, layout, pool, query, key, value, soft_cap
    )
    assert metadata.per_row and metadata.blocks.num_rows == 16  # rows bucketed 1, 4, 16, ...
    # A step with a prefill chunk keeps the one-sequence form.
    mixed = AttentionLayout(
        slot_mapping=torch.tensor([22, 40, 41]),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([[3, 5]]),
        decode_seq_lens=torch.tensor([7]),
        prefills=(PrefillChunk(1, 2, 0, torch.tensor([10])),),
        block_size=BLOCK_SIZE,
    )
    assert not flex.build_group(mixed, query.dtype, NUM_BLOCKS).per_row


class _NoStream:
    def wait_stream(self, other: object) -> None:
        pass


class _NoGraph:
    def replay(self) -> None:
        raise AssertionError("replays go through DecodeGraphs._replay in this test")


@pytest.mark.parametrize("per_row", [False, True])
def test_decode_graph_buffers_give_the_eager_tokens(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, per_row: bool
) -> None:
    """The CUDA-graph path on CPU, each replay an eager forward over the fixed buffers: the
    padding, the copies into the buffers and the captured block masks give the same tokens,
    in either form of a decode step (per row is CUDA's; the eager run here is not)."""
    for name, fake in {
        "Stream": _NoStream,
        "current_stream": _NoStream,
        "stream": lambda stream: nullcontext(),
        "CUDAGraph": _NoGraph,
        "graph": lambda graph, pool=None: nullcontext(),
        "graph_pool_handle": lambda: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)

    def replay_eagerly(self: DecodeGraphs, captured: Any) -> None:
        bucket = captured.hidden.shape[0]
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        captured.hidden.copy_(self.model(ids, positions, captured.metadata))

    monkeypatch.setattr(DecodeGraphs, "_replay", replay_eagerly)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(model_dirs["llama"]), attention_backend="flex", **ENGINE_ARGS)
    runner = llm.llm_engine.runner

    def tokens() -> list[list[int]]:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        return [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]

    eager = tokens()
    assert isinstance(runner.attention_backend, FlexAttention)
    runner.attention_backend.per_row_decode = per_row
    runner.fast_path = DecodeGraphs(runner.model, runner.attention_backend, NUM_BLOCKS, 8, CPU)
    assert tokens() == eager
    assert len(runner.decode_graphs.graphs) > 1  # several buckets captured and reused
    captured = runner.decode_graphs.graphs.values()
    assert {c.metadata.groups[0].per_row for c in captured} == {per_row}
