"""Bad input is refused with an error naming the parameter, and hurts no other request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, InvalidParameterError, ModelLoadError, SamplingParams
from kvserve.engine import LLMEngine
from model_fixtures import save_tiny_model, train_tiny_tokenizer

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


@pytest.fixture
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(
        str(model_dir), dtype="float32", block_size=4, num_blocks=64, max_model_len=MAX_MODEL_LEN
    )


GOOD_PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return results


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("n", 0),
        ("logprobs", 100),
        ("stop", [""]),
        ("seed", "seven"),
        ("min_tokens", 50),
    ],
)
def test_bad_sampling_params_name_the_parameter(field: str, value: Any) -> None:
    with pytest.raises(InvalidParameterError) as excinfo:
        SamplingParams(**{field: value})
    assert excinfo.value.param == field
    assert isinstance(excinfo.value, ValueError)
    assert field in str(excinfo.value)


@pytest.mark.parametrize(
    ("prompt", "params", "param_name"),
    [
        ("", GREEDY, "prompt"),
        ({"prompt_token_ids": []}, GREEDY, "prompt"),
        ({"prompt_token_ids": [1] * MAX_MODEL_LEN}, GREEDY, "prompt"),
        ({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=10), "max_tokens"),
        ({"prompt_token_ids": [1, 10**9]}, GREEDY, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, GREEDY, "prompt_token_ids"),
        ({"prompt_token_ids": ["a"]}, GREEDY, "prompt_token_ids"),
        ({"text": "no prompt key"}, GREEDY, "prompt"),
        (GOOD_PROMPT, SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    ],
)
def test_bad_requests_are_refused_and_others_still_finish(
    engine: LLMEngine, prompt: Any, params: SamplingParams, param_name: str
) -> None:
    engine.add_request("good-before", GOOD_PROMPT, GREEDY)
    with pytest.raises(InvalidParameterError) as excinfo:
        engine.add_request("bad", prompt, params)
    assert excinfo.value.param == param_name
    assert engine.get_num_unfinished_requests() == 1  # nothing of the bad request was queued
    engine.add_request("good-after", {"prompt_token_ids": [9, 10, 11]}, GREEDY)
    results = run_to_completion(engine)
    assert set(results) == {"good-before", "good-after"}
    alone = LLMEngine.from_engine_args(
        engine.config.model_config.model, dtype="float32", block_size=4, num_blocks=64
    )
    alone.add_request("x", GOOD_PROMPT, GREEDY)
    assert run_to_completion(alone)["x"] == results["good-before"]
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_duplicate_request_id_is_refused_without_touching_the_first(engine: LLMEngine) -> None:
    engine.add_request("same", GOOD_PROMPT, GREEDY)
    with pytest.raises(InvalidParameterError) as excinfo:
        engine.add_request("same", GOOD_PROMPT, GREEDY)
    assert excinfo.value.param == "request_id"
    assert len(run_to_completion(engine)["same"]) == 8


def test_a_bad_prompt_in_a_batch_queues_nothing(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_blocks=64)
    with pytest.raises(InvalidParameterError) as excinfo:
        llm.generate([GOOD_PROMPT, ""], GREEDY, use_tqdm=False)
    assert excinfo.value.param == "prompt"
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(GOOD_PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_request_larger_than_the_whole_pool_is_refused(model_dir: Path) -> None:
    engine = LLMEngine.from_engine_args(str(model_dir), dtype="float32", block_size=4, num_blocks=5)
    with pytest.raises(InvalidParameterError) as excinfo:
        engine.add_request("big", {"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=10))
    assert excinfo.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("engine_args", "param_name"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"dtype": "float8"}, "dtype"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
        ({"no_such_option": 1}, "no_such_option"),
        ({"max_model_len": 10**9}, "max_model_len"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"max_prefill_tokens_while_decoding": 0}, "max_prefill_tokens_while_decoding"),
    ],
)
def test_bad_engine_arguments_name_the_parameter(
    model_dir: Path, engine_args: dict[str, Any], param_name: str
) -> None:
    with pytest.raises(InvalidParameterError) as excinfo:
        LLM(str(model_dir), **engine_args)
    assert excinfo.value.param == param_name


def test_unknown_model_alias_is_refused() -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        LLM("no-such-model-alias")
    assert excinfo.value.param == "model"
    assert "smollm2-135m-instruct" in str(excinfo.value)  # the message lists known aliases


def test_truncated_and_unreadable_model_files_are_refused(model_dir: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for source in model_dir.iterdir():
        data = source.read_bytes()
        (truncated / source.name).write_bytes(
            data[: len(data) // 2] if source.suffix == ".safetensors" else data
        )
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model" * 100)
    for path in (truncated, garbage, tmp_path / "missing.gguf"):
        with pytest.raises(ModelLoadError) as excinfo:
            LLM(str(path), dtype="float32")
        assert excinfo.value.param == "model"
