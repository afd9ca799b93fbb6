"""static-vs-continuous: the same queue under both policies, checked step by step."""

from __future__ import annotations

from pathlib import Path

from kvserve.demos import DemoResult
from kvserve.demos.prompts import chat_token_ids
from kvserve.demos.static_vs_continuous import KINDS, QUEUE
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def test_continuous_takes_no_more_steps_than_static(demo_results: dict[str, DemoResult]) -> None:
    data = demo_results["static-vs-continuous"].data
    static, continuous = data["totals"]["static"], data["totals"]["continuous"]
    assert continuous["engine_steps"] <= static["engine_steps"]
    # The tiny model's answers differ in length, so refilling seats saves steps here.
    assert continuous["engine_steps"] < static["engine_steps"]
    assert static["generated_tokens"] == continuous["generated_tokens"]
    for totals in (static, continuous):
        runs = totals["wall_s_runs"]
        assert len(runs) == data["repeats"] and totals["wall_s"] == sorted(runs)[len(runs) // 2]


def test_static_batches_run_one_after_another(demo_results: dict[str, DemoResult]) -> None:
    data = demo_results["static-vs-continuous"].data
    seats = data["max_running"]
    spans = [r["static"] for r in data["requests"]]
    batch_start = 0
    for start in range(0, len(spans), seats):
        batch = spans[start : start + seats]
        # Each batch starts right after the previous one's last step, and lasts as long
        # as its longest answer (the prompts fit in one step, which samples a token).
        assert all(span["first_step"] == batch_start + 1 for span in batch)
        batch_start += max(span["answer_tokens"] for span in batch)
        assert max(span["finish_step"] for span in batch) == batch_start
    assert data["totals"]["static"]["engine_steps"] == batch_start


def test_continuous_refills_a_seat_in_the_next_step(demo_results: dict[str, DemoResult]) -> None:
    data = demo_results["static-vs-continuous"].data
    seats = data["max_running"]
    spans = [r["continuous"] for r in data["requests"]]
    finish_steps = sorted(span["finish_step"] for span in spans)
    for index, span in enumerate(spans):
        if index < seats:
            assert span["first_step"] == 1
        else:
            # The (index - seats + 1)-th request to finish frees the seat it takes.
            assert span["first_step"] == finish_steps[index - seats] + 1
        assert span["finish_step"] == span["first_step"] + span["answer_tokens"] - 1


def test_tables_agree_with_the_data(demo_results: dict[str, DemoResult]) -> None:
    result = demo_results["static-vs-continuous"]
    per_request, totals = result.tables
    for row, request in zip(per_request.rows, result.data["requests"], strict=True):
        assert row[1] == request["kind"]
        assert row[2:5] == (
            request["static"]["answer_tokens"],
            request["static"]["finish_step"],
            request["static"]["latency_s"],
        )
        assert row[5:8] == (
            request["continuous"]["answer_tokens"],
            request["continuous"]["finish_step"],
            request["continuous"]["latency_s"],
        )
        assert row[8] == request["static"]["latency_s"] / request["continuous"]["latency_s"]
    for row in totals.rows:
        assert row[1] == result.data["totals"][row[0]]["engine_steps"]


def test_answers_match_each_request_run_alone(
    demo_results: dict[str, DemoResult], tiny_model_dir: Path
) -> None:
    result = demo_results["static-vs-continuous"]
    # float32 is batch invariant: every answer is the same under both policies.
    assert result.data["num_same_answers"] == len(QUEUE)
    assert "Every answer is the same" in result.explanation
    assert [r["kind"] for r in result.data["requests"]] == list(KINDS)
    limits = result.context["sizes"]["max_tokens_each"]
    llm = LLM(str(tiny_model_dir), dtype="float32")
    for question, limit, request in zip(QUEUE, limits, result.data["requests"], strict=True):
        prompt = chat_token_ids(llm.llm_engine, [{"role": "user", "content": question}])
        alone = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=limit),
            use_tqdm=False,
        )[0]
        assert request["continuous"]["answer_tokens"] == len(alone.outputs[0].token_ids)
