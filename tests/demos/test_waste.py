"""The waste demo: per-request steps against one static batch, and the waste % they make."""

from __future__ import annotations

from pathlib import Path

from kvserve.demos import DemoResult
from kvserve.demos.prompts import chat_token_ids
from kvserve.demos.waste import QUESTIONS
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def test_waste_percent_is_wasted_over_total_slot_steps(demo_results: dict[str, DemoResult]) -> None:
    data = demo_results["waste"].data
    requests = data["requests"]
    assert len(requests) == data["num_slots"] == len(QUESTIONS)
    # Prompts are prefilled in the first step, which also samples each first token.
    assert data["batch_steps"] == max(r["answer_tokens"] for r in requests)
    for request in requests:
        assert request["steps_needed"] == request["finish_step"] == request["answer_tokens"]
        assert request["steps_after_finish"] == data["batch_steps"] - request["answer_tokens"]
        assert request["seconds_after_finish"] >= 0.0
    wasted = sum(r["steps_after_finish"] for r in requests)
    assert data["wasted_steps"] == wasted > 0
    assert data["slot_steps"] == data["batch_steps"] * data["num_slots"]
    assert data["waste_percent"] == 100.0 * wasted / data["slot_steps"]


def test_waste_tables_show_the_data(demo_results: dict[str, DemoResult]) -> None:
    result = demo_results["waste"]
    per_request, batch = result.tables
    for row, request in zip(per_request.rows, result.data["requests"], strict=True):
        assert row[1] == request["answer_tokens"]
        assert row[3:5] == (request["steps_needed"], request["steps_after_finish"])
    assert batch.rows[0][3:5] == (result.data["wasted_steps"], result.data["waste_percent"])


def test_waste_answers_match_each_request_run_alone(
    demo_results: dict[str, DemoResult], tiny_model_dir: Path
) -> None:
    """The batch's answer lengths are the ones each question gets without company."""
    result = demo_results["waste"]
    limits = result.context["sizes"]["max_tokens_each"]
    llm = LLM(str(tiny_model_dir), dtype="float32")
    for question, limit, request in zip(QUESTIONS, limits, result.data["requests"], strict=True):
        prompt = chat_token_ids(llm.llm_engine, [{"role": "user", "content": question}])
        alone = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=limit),
            use_tqdm=False,
        )[0]
        assert request["answer_tokens"] == len(alone.outputs[0].token_ids)
        assert request["finish_reason"] == alone.outputs[0].finish_reason
