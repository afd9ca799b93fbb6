"""AsyncEngine: the background loop, per-call streams, aborts, failures and idling."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve import InvalidParameterError, SamplingParams
from kvserve.engine import LLMEngine
from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.async_errors import EngineOverloadedError, RequestFailedError
from kvserve.engine.detokenizer import stop_prefix_len
from kvserve.engine.iteration_stats import IterationStats
from kvserve.engine.output_stream import RequestDelta
from kvserve.engine.own_thread import build_on_own_thread
from model_fixtures import save_tiny_model, train_tiny_tokenizer
from waiting import run_with_deadline, wait_for

PROMPT = [5, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


@pytest.fixture
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    llm_engine = LLMEngine.from_engine_args(
        str(model_dir), dtype="float32", block_size=4, num_blocks=128
    )
    history: list[IterationStats] = []
    async_engine = AsyncEngine(llm_engine, max_waiting_requests=4, stats_observer=history.append)
    async_engine.history = history  # type: ignore[attr-defined]
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


def greedy(max_tokens: int = 12, **params: Any) -> SamplingParams:
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return SamplingParams(max_tokens=max_tokens, **params)


async def collect(engine: AsyncEngine, *requests: PreparedRequest) -> dict[str, list[RequestDelta]]:
    deltas: dict[str, list[RequestDelta]] = {r.request_id: [] for r in requests}
    async with engine.generate(requests) as stream:
        async for delta in stream:
            deltas[delta.request_id].append(delta)
    return deltas


def test_streamed_deltas_add_up_to_the_offline_result(engine: AsyncEngine) -> None:
    request = engine.prepare("a", PROMPT, greedy(n=2, seed=3, temperature=0.8))
    deltas = run_with_deadline(collect(engine, request))["a"]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for index in range(2):
        parts = [c for d in deltas for c in d.outputs if c.index == index]
        token_ids = [t for c in parts for t in c.token_ids]
        assert len(token_ids) == 12
        text = "".join(c.text for c in parts)
        assert text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)
        assert parts[-1].finish_reason == "length"
    history: list[IterationStats] = engine.history  # type: ignore[attr-defined]
    wait_for(lambda: any(stats.finished for stats in history))
    (finished,) = [f for stats in history for f in stats.finished]
    assert (finished.finish_reason, finished.num_generation_tokens) == ("length", 24)
    assert sum(stats.num_generation_tokens for stats in history) == 24
    assert len([t for stats in history for t in stats.time_to_first_token]) == 1


def test_bad_request_raises_before_anything_is_queued(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidParameterError) as error:
        engine.prepare("bad", PROMPT, greedy(max_tokens=10**6))
    assert error.value.param == "max_tokens"
    assert not engine.engine.has_unfinished_requests()


def test_leaving_the_stream_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def read_two() -> None:
        request = engine.prepare("long", PROMPT, greedy(max_tokens=400))
        async with engine.generate([request]) as stream:
            async for _ in stream:
                if engine.engine.kv_cache_manager.num_free_blocks < 127:
                    break

    run_with_deadline(read_two())
    manager = engine.engine.kv_cache_manager
    wait_for(lambda: manager.num_free_blocks == manager.num_usable_blocks)
    assert not engine.engine.has_unfinished_requests()
    history: list[IterationStats] = engine.history  # type: ignore[attr-defined]
    wait_for(lambda: any(stats.finished for stats in history))
    (finished,) = [f for stats in history for f in stats.finished]
    assert finished.finish_reason == "abort" and finished.num_generation_tokens < 400


def test_loop_sleeps_when_idle_and_wakes_for_a_request(engine: AsyncEngine) -> None:
    run_with_deadline(collect(engine, engine.prepare("warm", PROMPT, greedy(max_tokens=2))))
    # The loop clears its wake-up event before each turn: once that is clear and nothing is
    # left to run, the loop is in (or bound for) its wait, however slowly it got there.
    wait = engine._inbox.wake
    wait_for(lambda: not engine.engine.has_unfinished_requests() and not wait.is_set())
    time.sleep(0.05)
    iterations = engine.num_iterations
    time.sleep(0.3)
    assert engine.num_iterations == iterations  # no busy spin
    deltas = run_with_deadline(collect(engine, engine.prepare("b", PROMPT, greedy(max_tokens=3))))
    assert deltas["b"][-1].finished


def test_the_waiting_limit_counts_the_sequences_a_request_would_add(model_dir: Path) -> None:
    llm_engine = LLMEngine.from_engine_args(
        str(model_dir), dtype="float32", block_size=4, num_blocks=128
    )
    engine = AsyncEngine(llm_engine, max_waiting_requests=4)
    in_step, release = threading.Event(), threading.Event()
    real_step = llm_engine.step

    def held_step() -> Any:
        # Holds the loop after it added the first request and before it scheduled it.
        in_step.set()
        assert release.wait(10)
        return real_step()

    llm_engine.step = held_step  # type: ignore[method-assign]
    engine.start()

    async def flood() -> None:
        with pytest.raises(InvalidParameterError) as error:  # could never be admitted
            engine.generate([engine.prepare("huge", PROMPT, greedy(n=5))])
        assert error.value.param == "n"
        async with engine.generate([engine.prepare("w", PROMPT, greedy(n=2))]) as first:
            assert in_step.wait(10)  # 2 sequences wait
            with pytest.raises(EngineOverloadedError):
                engine.generate([engine.prepare("x", PROMPT, greedy(n=3))])  # 2 + 3 > 4
            async with engine.generate([engine.prepare("y", PROMPT, greedy(n=2))]) as second:
                with pytest.raises(EngineOverloadedError):  # 4 wait: even one more is too many
                    engine.generate([engine.prepare("z", PROMPT, greedy())])
                release.set()
                assert [d async for d in second][-1].finished
            assert [d async for d in first][-1].finished

    try:
        run_with_deadline(flood())
    finally:
        release.set()
        engine.shutdown()


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    runner = engine.engine.runner
    real_execute = runner.execute

    def execute(scheduler_output: Any) -> Any:
        if any(item.request.prompt_token_ids[0] == 13 for item in scheduler_output.scheduled):
            raise RuntimeError("poisoned")
        return real_execute(scheduler_output)

    runner.execute = execute  # type: ignore[method-assign]
    with (
        caplog.at_level(logging.ERROR, logger="kvserve"),
        pytest.raises(RequestFailedError) as failure,
    ):
        run_with_deadline(collect(engine, engine.prepare("p", [13, *PROMPT], greedy())))
    # The exception names the log record that holds the details, not the details.
    assert "poisoned" not in str(failure.value)
    error_id = failure.value.error_id
    assert error_id is not None and error_id in str(failure.value)
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.exc_info is not None and "poisoned" in str(record.exc_info[1])
    deltas = run_with_deadline(collect(engine, engine.prepare("ok", PROMPT, greedy())))
    assert sum(len(c.token_ids) for d in deltas["ok"] for c in d.outputs) == 12
    manager = engine.engine.kv_cache_manager
    wait_for(lambda: manager.num_free_blocks == manager.num_usable_blocks)
    assert engine.is_healthy


def test_streamed_text_never_includes_a_stop_string_it_later_cuts(engine: AsyncEngine) -> None:
    full = run_with_deadline(collect(engine, engine.prepare("f", PROMPT, greedy(max_tokens=24))))[
        "f"
    ]
    full_text = "".join(c.text for d in full for c in d.outputs)
    stop = full_text[6:10]
    expected = full_text[: full_text.index(stop)]
    deltas = run_with_deadline(
        collect(engine, engine.prepare("s", PROMPT, greedy(24, stop=[stop])))
    )
    pieces = [c.text for d in deltas["s"] for c in d.outputs]
    assert "".join(pieces) == expected
    assert deltas["s"][-1].outputs[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello wor", ["world"], 3),
        ("hello", ["world"], 0),
        ("abab", ["abc"], 2),
        ("xxa", ["ab", "aab"], 1),
        ("xaa", ["ab", "aab"], 2),
        ("", ["ab"], 0),
        ("end.", ["."], 0),  # a whole stop string is matched by the engine, not held
    ],
)
def test_stop_prefix_len_is_the_longest_partial_match(
    text: str, stops: list[str], expected: int
) -> None:
    assert stop_prefix_len(text, stops) == expected


def test_build_on_own_thread_runs_elsewhere_and_hands_back_result_or_error() -> None:
    # The server loads its model this way (see build_on_own_thread for why).
    assert build_on_own_thread(threading.get_ident) != threading.get_ident()

    def refuse() -> None:
        raise InvalidParameterError("max_num_seqs", "must be a positive integer, got 0")

    with pytest.raises(InvalidParameterError) as excinfo:
        build_on_own_thread(refuse)
    assert excinfo.value.param == "max_num_seqs"
