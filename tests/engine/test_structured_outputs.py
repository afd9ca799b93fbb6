"""Structured outputs in the engine, on a tiny random model: what the grammar allows, only.

A random model left alone produces arbitrary tokens, so every constrained
output that matches its regex or choice is the grammar's doing. The
references are independent: Python's ``re`` for regexes, the choice list, the
same requests run alone (unconstrained rows beside constrained ones) and the
same request run without preemption.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from test_request_isolation import run_to_end as run

from kvserve import InvalidParameterError, SamplingParams, StructuredOutputsParams
from kvserve.engine import LLMEngine
from model_fixtures import save_tiny_model, train_tiny_tokenizer

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
PREEMPT_PATTERN = "[0-9]{40}"
CHOICES = ["red", "green", "blue", "a longer choice with spaces"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


def new_engine(model_dir: Path, **args: Any) -> LLMEngine:
    return LLMEngine.from_engine_args(
        str(model_dir), dtype="float32", block_size=4, **{"num_blocks": 128, **args}
    )


def constrained(**spec: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice_outputs_match(model_dir: Path, temperature: float) -> None:
    engine = new_engine(model_dir)
    common = {"temperature": temperature, "seed": 3, "max_tokens": 40, "n": 3}
    requests = {
        "date": ([5, 6, 7], SamplingParams(**common, structured_outputs=constrained(regex=DATE))),
        "phone": ([8, 9], SamplingParams(**common, structured_outputs=constrained(regex=PHONE))),
        "choice": (
            [10, 11],
            SamplingParams(**common, structured_outputs=constrained(choice=CHOICES)),
        ),
    }
    outputs = run(engine, requests)
    for completion in outputs["date"].outputs:
        assert re.fullmatch(DATE, completion.text), completion.text
        assert completion.finish_reason == "stop"
    for completion in outputs["phone"].outputs:
        assert re.fullmatch(PHONE, completion.text), completion.text
    for completion in outputs["choice"].outputs:
        assert completion.text in CHOICES
    # No sequence's matcher is left behind.
    assert not engine._compiling


def test_unconstrained_rows_unchanged_by_constrained_neighbours(model_dir: Path) -> None:
    free = {
        "greedy": (
            [5, 17, 42, 99, 7],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        ),
        "seeded": (
            [8, 9, 10],
            SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
        ),
    }
    alone = run(new_engine(model_dir), free)
    mixed = run(
        new_engine(model_dir),
        {
            **free,
            "regex": (
                [5, 17, 42],
                SamplingParams(
                    temperature=0, max_tokens=30, structured_outputs=constrained(regex=PHONE)
                ),
            ),
            "choice": (
                [3, 4],
                SamplingParams(
                    temperature=1.0,
                    seed=1,
                    max_tokens=30,
                    structured_outputs=constrained(choice=CHOICES),
                ),
            ),
        },
    )
    for request_id in free:
        got, want = mixed[request_id].outputs[0], alone[request_id].outputs[0]
        assert got.token_ids == want.token_ids
        assert got.text == want.text
    assert re.fullmatch(PHONE, mixed["regex"].outputs[0].text)


def test_logprobs_are_those_of_allowed_tokens(model_dir: Path) -> None:
    engine = new_engine(model_dir)
    params = SamplingParams(
        temperature=0, max_tokens=20, logprobs=3, structured_outputs=constrained(regex="[0-9]{6}")
    )
    output = run(engine, {"r": ([4, 5, 6], params)})["r"].outputs[0]
    assert re.fullmatch("[0-9]{6}", output.text)
    tokenizer = engine.tokenizer
    assert output.logprobs is not None
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        assert entry[token_id].rank == 1  # greedy over the allowed tokens
        for alternative, logprob in entry.items():
            if logprob.logprob > float("-inf"):
                assert tokenizer.decode([alternative]).isdigit()


def test_preempted_constrained_request_resumes_in_its_grammar(model_dir: Path) -> None:
    def requests() -> dict[str, tuple[list[int], SamplingParams]]:
        spec = constrained(regex=PREEMPT_PATTERN)
        return {
            f"r{i}": (
                [3 + i, 20, 21, 22, 23, 24, 25, 26],
                SamplingParams(temperature=0, max_tokens=50, structured_outputs=spec),
            )
            for i in range(6)
        }

    roomy = run(new_engine(model_dir), requests())
    # Each request ends with 12 to 15 blocks of 4 tokens: 24 cannot hold them all.
    tight_engine = new_engine(model_dir, num_blocks=25)
    tight = run(tight_engine, requests())
    assert tight_engine.scheduler.num_preemptions_total > 0
    for request_id, output in tight.items():
        completion = output.outputs[0]
        assert re.fullmatch(PREEMPT_PATTERN, completion.text), completion.text
        assert completion.token_ids == roomy[request_id].outputs[0].token_ids


def test_abort_frees_grammar_state(model_dir: Path) -> None:
    engine = new_engine(model_dir)
    params = SamplingParams(
        temperature=0, max_tokens=30, n=2, structured_outputs=constrained(regex="[0-9]{20}")
    )
    engine.add_request("a", {"prompt_token_ids": [3, 4, 5]}, params)
    engine.step()
    engine.step()
    requests = [seq.request for seq in engine._groups["a"].sequences]
    assert all(request.grammar is not None for request in requests)
    engine.abort_request("a")
    assert all(request.grammar is None for request in requests)
    assert not engine.has_unfinished_requests() and not engine._compiling
    # Aborted before its grammar was ever admitted: it leaves nothing either.
    engine.add_request(
        "b",
        {"prompt_token_ids": [3, 4, 5]},
        SamplingParams(structured_outputs=constrained(regex="x{1,3}[0-9]{7}")),
    )
    engine.abort_request("b")
    assert not engine._compiling and not engine.has_unfinished_requests()


def test_grammar_cache_compiles_each_spec_once(model_dir: Path) -> None:
    engine = new_engine(model_dir)
    compiler = engine.grammar_compiler
    before = compiler.stats.misses
    for index in range(3):
        params = SamplingParams(
            temperature=0, max_tokens=10, structured_outputs=constrained(choice=["x", "y"])
        )
        run(engine, {f"c{index}": ([3, 4], params)})
    assert compiler.stats.misses == before + 1
    assert compiler.stats.hits >= 2


def test_gbnf_and_lark_grammars(model_dir: Path) -> None:
    engine = new_engine(model_dir)
    gbnf = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'
    lark = 'start: "(" /[0-9]+/ ("+" /[0-9]+/)* ")"'
    for index, grammar in enumerate((gbnf, lark)):
        params = SamplingParams(
            temperature=1.0,
            seed=index,
            max_tokens=40,
            structured_outputs=constrained(grammar=grammar),
        )
        completion = run(engine, {"g": ([3, 4], params)})["g"].outputs[0]
        if completion.finish_reason == "stop":
            assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", completion.text), completion.text
        else:  # cut by max_tokens: a prefix of a sentence
            assert re.fullmatch(r"\([0-9]*(\+[0-9]*)*", completion.text), completion.text


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a"] * 300}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": [1, 2]}, "structured_outputs.json"),
        (
            {
                "json": {
                    "type": "object",
                    "properties": {
                        "a": {
                            "items": [
                                [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[{}]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
                            ]
                        }
                    },
                }
            },
            "structured_outputs.json",
        ),
        ({"grammar": "x" * 70000}, "structured_outputs.grammar"),
    ],
)
def test_bad_specs_are_refused_when_built(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        StructuredOutputsParams(**spec)
    assert caught.value.param == field


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"regex": "[0-9"}, "structured_outputs.regex"),
        ({"regex": "(?<=a)b"}, "structured_outputs.regex"),
        (
            {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
            "structured_outputs.json",
        ),
        ({"json": {"type": "strange"}}, "structured_outputs.json"),
        ({"grammar": "root ::= ( unclosed"}, "structured_outputs.grammar"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_specs_that_do_not_compile_are_refused_before_queuing(
    model_dir: Path, spec: dict[str, Any], field: str
) -> None:
    engine = new_engine(model_dir)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(InvalidParameterError) as caught:
        engine.validator.check_grammar(params)
    assert caught.value.param == field
    # Queued anyway (LLMEngine.add_request does not wait): the request fails alone.
    engine.add_request("bad", {"prompt_token_ids": [3, 4]}, params)
    engine.add_request(
        "good", {"prompt_token_ids": [3, 4]}, SamplingParams(temperature=0, max_tokens=4)
    )
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert outputs["bad"].error is not None and outputs["bad"].outputs[0].finish_reason == "error"
    assert outputs["good"].error is None and len(outputs["good"].outputs[0].token_ids) == 4


def test_chunked_prefill_and_prefix_hits_change_no_constrained_output(model_dir: Path) -> None:
    prompt = [3 + (i * 7) % 90 for i in range(30)]

    def requests(tag: str) -> dict[str, tuple[list[int], SamplingParams]]:
        return {
            f"{tag}-{kind}": (
                prompt,
                SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec),
            )
            for kind, spec in (
                ("date", constrained(regex=DATE)),
                ("choice", constrained(choice=CHOICES)),
            )
        }

    plain = run(new_engine(model_dir, enable_prefix_caching=False), requests("a"))
    engine = new_engine(
        model_dir, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4
    )
    first = run(engine, requests("a"))
    again = run(engine, requests("b"))  # the prompt's blocks now come from the prefix cache
    assert engine.kv_cache_manager.enable_caching
    for kind in ("date", "choice"):
        want = plain[f"a-{kind}"].outputs[0]
        for got in (first[f"a-{kind}"].outputs[0], again[f"b-{kind}"].outputs[0]):
            assert got.token_ids == want.token_ids and got.text == want.text
    assert re.fullmatch(DATE, plain["a-date"].outputs[0].text)
    assert plain["a-choice"].outputs[0].text in CHOICES
