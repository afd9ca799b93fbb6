"""Tensor parallelism: two ranks give the single-process engine's logits and tokens.

The reference is the same engine with one rank (itself checked against
transformers in tests/models/). Both runs see the same schedule, step by
step: a long prompt prefilled in chunks beside running decodes, in a KV pool
small enough that the scheduler preempts. Every collective has a timeout
(``distributed_timeout_s``), and waits in the tests are bounded too.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvserve.core.scheduler import SchedulerOutput
from kvserve.distributed.group import TensorParallelError
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.async_errors import EngineDeadError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import ModelInputs
from kvserve.worker.model_runner import ModelRunnerOutput
from model_fixtures import TINY_VOCAB_SIZE, save_tiny_model, train_tiny_tokenizer

# Small enough to chunk the long prompt beside the decodes (16 tokens a step) and
# to run out of blocks (the requests want ~45 blocks of 4 tokens; the pool has 24).
ENGINE_ARGS = dict(
    dtype="float32",
    block_size=4,
    num_blocks=24,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    distributed_timeout_s=20.0,
)
STEP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tiny_tokenizer()
    return {
        kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer)
        for kind in ("llama", "qwen2")
    }


@dataclass
class Run:
    """What one engine did with the workload: tokens per request, logits and schedule per step."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: list[torch.Tensor] = field(default_factory=list)
    schedules: list[SchedulerOutput] = field(default_factory=list)


def run_workload(engine: LLMEngine) -> Run:
    """Three short prompts decoding while a 60-token prompt is prefilled in chunks."""
    run = Run()
    runner = engine.runner
    compute_logits, execute = runner.model.compute_logits, runner.execute

    def recording_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        run.logits.append(logits.clone())
        return logits

    def recording_execute(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        run.schedules.append(scheduler_output)
        return execute(scheduler_output)

    runner.model.compute_logits = recording_logits
    runner.execute = recording_execute
    rng = random.Random(0)
    prompts = [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in (6, 9, 11, 60)]
    for index, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        engine.add_request(f"r{index}", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                run.tokens[output.request_id] = output.outputs[0].token_ids
    return run


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def runs(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Iterator[list[Run]]:
    """The workload with one rank, then with two (each engine closed before the next)."""
    results = []
    for size in (1, 2):
        engine = LLMEngine.from_engine_args(
            str(tiny_models[request.param]), tensor_parallel_size=size, **ENGINE_ARGS
        )
        try:
            with ThreadPoolExecutor(1) as pool:
                results.append(pool.submit(run_workload, engine).result(STEP_TIMEOUT_S))
        finally:
            engine.shutdown()
    yield results


def test_two_ranks_give_the_single_rank_logits_and_tokens(runs: list[Run]) -> None:
    single, split = runs
    assert split.tokens == single.tokens
    assert len(split.logits) == len(single.logits)
    for step, (expected, got) in enumerate(zip(single.logits, split.logits, strict=True)):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"step {step}")


def test_the_workload_chunks_a_prompt_beside_decodes_and_preempts(runs: list[Run]) -> None:
    for run in runs:
        mixed = [
            s
            for s in run.schedules
            if any(item.num_new_tokens > 1 for item in s.scheduled)
            and any(item.is_decode for item in s.scheduled)
        ]
        assert len(mixed) >= 3
        assert sum(s.num_preempted for s in run.schedules) >= 1
    # Both engines took the same steps (the logits comparison pairs them up).
    assert [s.total_num_scheduled_tokens for s in runs[0].schedules] == [
        s.total_num_scheduled_tokens for s in runs[1].schedules
    ]


@pytest.mark.parametrize(
    ("size", "expected"),
    [(3, "must divide the model's 4 attention heads, 2 KV heads"), (4, "allowed: 1, 2")],
)
def test_a_size_that_does_not_split_the_heads_is_refused_before_any_rank_starts(
    tiny_models: dict[str, Path], size: int, expected: str
) -> None:
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size") as error:
        LLMEngine.from_engine_args(str(tiny_models["llama"]), tensor_parallel_size=size)
    assert expected in str(error.value)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_a_size_that_is_not_a_positive_integer_is_refused(
    tiny_models: dict[str, Path], size: object
) -> None:
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        LLMEngine.from_engine_args(str(tiny_models["llama"]), tensor_parallel_size=size)


@pytest.fixture
def split_engine(tiny_models: dict[str, Path]) -> Iterator[LLMEngine]:
    """A two-rank engine whose collectives give up after 3 s, with a request queued."""
    engine = LLMEngine.from_engine_args(
        str(tiny_models["llama"]),
        tensor_parallel_size=2,
        **(ENGINE_ARGS | {"distributed_timeout_s": 3.0}),
    )
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8))
    try:
        yield engine
    finally:
        engine.shutdown()
    assert multiprocessing.active_children() == []


def step_once(engine: LLMEngine) -> None:
    """One step, in a thread: a hang fails the test instead of stopping the suite."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(engine.step).result(STEP_TIMEOUT_S)


def run_step_with(engine: LLMEngine, signal_number: int) -> None:
    """A step during which the worker rank gets ``signal_number``, once it has the step's
    inputs and waits in the first all-reduce."""
    ranks = engine.worker_ranks
    assert ranks is not None
    pid = ranks.processes[0].pid
    assert pid is not None
    forward = engine.runner.forward

    def signal_worker_then_forward(inputs: ModelInputs) -> torch.Tensor:
        os.kill(pid, signal_number)
        return forward(inputs)

    engine.runner.forward = signal_worker_then_forward
    step_once(engine)


def test_a_rank_that_dies_mid_step_makes_the_engine_raise(split_engine: LLMEngine) -> None:
    step_once(split_engine)
    with pytest.raises(TensorParallelError, match="rank 1 exited"):
        run_step_with(split_engine, signal.SIGKILL)
    # Every later step fails the same way, at once.
    with pytest.raises(TensorParallelError, match="rank 1 exited"):
        step_once(split_engine)


def test_a_rank_that_stops_answering_fails_the_step_after_the_timeout(
    split_engine: LLMEngine,
) -> None:
    step_once(split_engine)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="collective failed"):
        run_step_with(split_engine, signal.SIGSTOP)
    assert 3 <= time.monotonic() - started < 30


def test_a_dead_rank_stops_the_async_engine_and_fails_its_streams(
    split_engine: LLMEngine,
) -> None:
    ranks = split_engine.worker_ranks
    assert ranks is not None
    ranks.processes[0].kill()
    ranks.processes[0].join(STEP_TIMEOUT_S)
    async_engine = AsyncEngine(split_engine)
    async_engine.start()
    try:
        request = async_engine.prepare("b", [9, 10, 11], SamplingParams(max_tokens=4))

        async def consume() -> None:
            async with async_engine.generate([request]) as stream:
                async for _ in stream:
                    pass

        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(consume(), STEP_TIMEOUT_S))
        assert not async_engine.is_healthy
    finally:
        async_engine.shutdown()
