"""A failure that belongs to one request fails that request alone.

Faults are injected into per-request work (building one row's sampling
inputs, detokenizing one request's tokens). The failed request ends with
``error``, its blocks are freed, and every other request in the same steps
generates what it generates without the failed one.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from kvserve import SamplingParams
from kvserve.engine import LLMEngine, request_group
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.async_errors import RequestFailedError
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sample import SamplingMetadata
from model_fixtures import save_tiny_model, train_tiny_tokenizer
from waiting import run_with_deadline

POISON = 13  # the faulty request's prompt starts with this token
FAIL_AFTER = 3  # output tokens the faulty request gets before its fault


def params(**values: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **values})


# The requests that must not notice the faulty one: greedy with logprobs, a
# longer greedy one, and seeded sampling.
HEALTHY: dict[str, tuple[list[int], SamplingParams]] = {
    "greedy": ([5, 17, 42, 99, 7, 250], params(logprobs=2)),
    "long": ([3, 8, 21, 34, 55, 89] * 3, params(max_tokens=16)),
    "seeded": ([8, 9, 10], params(temperature=0.8, seed=7)),
}
FAULTY_PROMPT = [POISON, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


def new_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(str(model_dir), dtype="float32", block_size=4, num_blocks=128)


def run_to_end(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def assert_same_completion(got: CompletionOutput, want: CompletionOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    # The batch around them differs, and so may the last bits of a float sum.
    assert (got.logprobs is None) == (want.logprobs is None)
    for got_entry, want_entry in zip(got.logprobs or [], want.logprobs or [], strict=True):
        assert got_entry.keys() == want_entry.keys()
        for token_id, entry in got_entry.items():
            assert math.isclose(entry.logprob, want_entry[token_id].logprob, abs_tol=1e-4)


def assert_healthy_unaffected(outputs: dict[str, RequestOutput], model_dir: Path) -> None:
    alone = run_to_end(new_engine(model_dir), HEALTHY)
    for request_id in HEALTHY:
        assert outputs[request_id].error is None
        for got, want in zip(outputs[request_id].outputs, alone[request_id].outputs, strict=True):
            assert_same_completion(got, want)


def assert_no_block_held(engine: LLMEngine) -> None:
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert not engine.scheduler.requests


def test_a_request_whose_sampling_fails_fails_alone(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = SamplingMetadata.from_requests

    def faulty_build(requests: Any, vocab_size: int, device: Any) -> SamplingMetadata:
        # Only the second of the faulty request's two sequences is broken.
        if any(r.request_id == "faulty#1" and r.num_output_tokens >= FAIL_AFTER for r in requests):
            raise RuntimeError("injected sampling fault")
        return build(requests, vocab_size, device)

    monkeypatch.setattr(SamplingMetadata, "from_requests", staticmethod(faulty_build))
    engine = new_engine(model_dir)
    faulty = (FAULTY_PROMPT, params(n=2))
    outputs = run_to_end(engine, {**HEALTHY, "faulty": faulty})

    failed = outputs["faulty"]
    assert failed.error is not None and "injected sampling fault" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    # The broken sequence stopped at its fault, and its sibling with it.
    assert len(failed.outputs[1].token_ids) == FAIL_AFTER
    assert len(failed.outputs[0].token_ids) < 12
    assert_no_block_held(engine)
    assert_healthy_unaffected(outputs, model_dir)


class FaultyDetokenizer(IncrementalDetokenizer):
    """Raises on the faulty request's token number FAIL_AFTER + 1."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], *args: Any) -> None:
        super().__init__(tokenizer, prompt_token_ids, *args)
        self.faulty = prompt_token_ids[0] == POISON
        self.num_appended = 0

    def append(self, token_id: int) -> str | None:
        self.num_appended += 1
        if self.faulty and self.num_appended > FAIL_AFTER:
            raise RuntimeError("injected detokenizer fault")
        return super().append(token_id)


def test_a_request_whose_text_fails_fails_alone(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(request_group, "IncrementalDetokenizer", FaultyDetokenizer)
    engine = new_engine(model_dir)
    faulty = (FAULTY_PROMPT, params())
    outputs = run_to_end(engine, {**HEALTHY, "faulty": faulty})

    failed = outputs["faulty"]
    assert failed.error is not None and "injected detokenizer fault" in failed.error
    assert failed.outputs[0].finish_reason == "error"
    assert_no_block_held(engine)
    assert_healthy_unaffected(outputs, model_dir)


def test_async_streams_of_the_others_complete_when_one_request_fails(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(request_group, "IncrementalDetokenizer", FaultyDetokenizer)
    engine = AsyncEngine(new_engine(model_dir))
    engine.start()
    try:
        requests = {**HEALTHY, "faulty": (FAULTY_PROMPT, params())}

        async def stream(request_id: str) -> list[int]:
            prompt, params = requests[request_id]
            token_ids: list[int] = []
            async with engine.generate([engine.prepare(request_id, prompt, params)]) as deltas:
                async for delta in deltas:
                    token_ids += delta.outputs[0].token_ids if delta.outputs else []
            return token_ids

        async def all_streams() -> list[Any]:
            return await asyncio.gather(*map(stream, requests), return_exceptions=True)

        results = dict(zip(requests, run_with_deadline(all_streams()), strict=True))
        error = results["faulty"]
        assert isinstance(error, RequestFailedError)
        # The stream gets an error id, never the internal text; the log has the details.
        assert "injected detokenizer fault" not in str(error)
        assert error.error_id is not None
        logged = [r.getMessage() for r in caplog.records if error.error_id in r.getMessage()]
        assert len(logged) == 1 and "injected detokenizer fault" in logged[0]
        alone = run_to_end(new_engine(model_dir), HEALTHY)
        for request_id in HEALTHY:
            assert results[request_id] == alone[request_id].outputs[0].token_ids
        assert_no_block_held(engine.engine)
        assert engine.is_healthy
    finally:
        engine.shutdown()


def test_the_sampling_inputs_are_built_before_the_forward_pass(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU, building them after the pass is queued would wait for the whole pass
    # (their copies to the device synchronize); every step builds them first.
    engine = new_engine(model_dir)
    events: list[str] = []
    build = SamplingMetadata.from_requests

    def recording_build(*args: Any, **kwargs: Any) -> SamplingMetadata:
        events.append("sampling inputs")
        return build(*args, **kwargs)

    forward = engine.runner.forward

    def recording_forward(*args: Any, **kwargs: Any) -> Any:
        events.append("forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(SamplingMetadata, "from_requests", staticmethod(recording_build))
    monkeypatch.setattr(engine.runner, "forward", recording_forward)
    outputs = run_to_end(engine, {"greedy": HEALTHY["greedy"], "seeded": HEALTHY["seeded"]})
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs.values())
    steps = [events[i : i + 2] for i in range(0, len(events), 2)]
    assert steps and all(step == ["sampling inputs", "forward"] for step in steps), events
