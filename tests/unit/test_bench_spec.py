"""``kvserve bench spec``: its --methods entries, its table, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.benchmarks.offline import spec
from kvserve.benchmarks.offline.spec import Cell, parse_method, spec_table
from kvserve.config import SpeculativeConfig
from kvserve.errors import InvalidParameterError
from model_fixtures import save_tiny_model, train_tiny_tokenizer


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    spec.register(root.add_subparsers())
    return root


def test_a_method_entry_sets_its_fields_by_alias_or_full_name() -> None:
    parsed = parse_method("ngram:k=5,min=3,prompt_lookup_max=6")
    assert parsed.label == "ngram:k=5,min=3,prompt_lookup_max=6"
    assert parsed.config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=5, prompt_lookup_min=3, prompt_lookup_max=6
    )
    # A bare method takes the config's defaults.
    assert parse_method("ngram").config == SpeculativeConfig()
    # Booleans and floats as --speculative-config's JSON would give them.
    parsed = parse_method("suffix:adaptive=false,suffix_decoding_min_token_prob=0.25")
    assert parsed.config.adaptive is False
    assert parsed.config.suffix_decoding_min_token_prob == 0.25


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("ngram:k=0", "num_speculative_tokens"),
        ("ngram:k=five", "num_speculative_tokens"),
        ("ngram:depth=3", "unknown field"),
        ("ngram:k", "METHOD[:FIELD=VALUE"),
        ("ngram:min=5,max=2", "prompt_lookup_min"),
        ("beam", "speculative_config.method"),
        ("ngram:adaptive=no", "speculative_config.adaptive"),
    ],
)
def test_a_bad_method_entry_is_refused_naming_what_is_wrong(text: str, names: str) -> None:
    with pytest.raises(InvalidParameterError, match="methods") as info:
        parse_method(text)
    assert names in str(info.value)


def test_the_command_line_defaults_and_refusals() -> None:
    args = parser().parse_args(["spec"])
    assert [m.label for m in args.methods] == ["ngram:k=3", "ngram:k=5"]
    assert [m.config.num_speculative_tokens for m in args.methods] == [3, 5]
    assert args.workloads == ["code-edit", "document-qa", "json-extract", "chat"]
    assert (args.output_len, args.repetitions) == (256, 3)
    # --speculative-config is the bench's own business (--methods), not an engine flag here.
    with pytest.raises(SystemExit):
        parser().parse_args(["spec", "--speculative-config", "{}"])
    with pytest.raises(SystemExit):
        parser().parse_args(["spec", "--methods", "ngram:k=99"])
    with pytest.raises(SystemExit):
        parser().parse_args(["spec", "--workloads", "poetry"])


def cell(ms_per_token: float, proposed: int, accepted: int, tokens: list[int]) -> Cell:
    return Cell(len(tokens), ms_per_token, 1000 / ms_per_token, proposed, accepted, tokens)


def test_the_table_gives_acceptance_speed_up_and_whether_the_tokens_match() -> None:
    results = {
        "code-edit": {
            "off": cell(20.0, 0, 0, [1, 2, 3]),
            "ngram:k=3": cell(10.0, 40, 30, [1, 2, 3]),
            "ngram:k=5": cell(25.0, 8, 0, [1, 2, 4]),
        },
        "chat": {"off": cell(20.0, 0, 0, [5]), "ngram:k=3": cell(20.0, 0, 0, [5])},
    }
    rows = [[c.strip() for c in row] for row in spec_table(results).rows]
    assert rows[0][:2] == ["code-edit", "off"]
    assert rows[0][5:] == ["-", "1.00x", "-"]
    # 20 ms over 10 ms: twice as fast; 30 of 40 proposals accepted.
    assert rows[1][1] == "ngram:k=3" and rows[1][3:] == ["10.0", "100.0", "75%", "2.00x", "yes"]
    assert rows[2][5:] == ["0%", "0.80x", "NO"]
    # Nothing proposed: no acceptance rate rather than a division by zero.
    assert rows[4][5:] == ["-", "1.00x", "yes"]


def test_the_workload_texts_ask_for_what_their_names_say() -> None:
    from kvserve.benchmarks.workloads import spec_texts

    code_lines = spec_texts.CODE_FUNCTION.splitlines()
    assert 50 <= len(code_lines) <= 70 and code_lines[0].startswith("def ")
    assert spec_texts.CODE_FUNCTION.count("bucket") > 10
    assert "`bucket` renamed to `totals`" in spec_texts.CODE_EDIT_REQUEST
    # About 1,000 tokens: English runs near 1.3 tokens per word.
    assert 650 <= len(spec_texts.DOCUMENT.split()) <= 900
    assert spec_texts.DOCUMENT in spec_texts.DOCUMENT_QUESTION
    # The question comes after the report and asks for its first section, quoted whole.
    question = spec_texts.DOCUMENT_QUESTION.removeprefix(spec_texts.DOCUMENT)
    assert question != spec_texts.DOCUMENT_QUESTION and "sources and storage" in question
    assert spec_texts.DOCUMENT.split("\n\n")[2].startswith("Sources and storage.")
    assert spec_texts.FACTS in spec_texts.JSON_REQUEST
    assert set(spec.WORKLOADS) == {"code-edit", "document-qa", "json-extract", "chat"}


def test_a_tiny_run_measures_every_setting_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model(
        tmp_path / "model", "llama", train_tiny_tokenizer(), max_position_embeddings=4096
    )
    argv = ["spec", "--model", str(model_dir), "--workloads", "code-edit", "chat"]
    argv += ["--methods", "ngram:k=2,min=1,max=2", "--output-len", "12", "--repetitions", "1"]
    argv += ["--json", str(tmp_path / "out.json"), "--block-size", "4"]
    args = parser().parse_args(argv)
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ")
    assert "greedy, batch 1, at most 12 output tokens, median of 1" in out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["args"]["methods"] == ["ngram:k=2,min=1,max=2"]
    for workload in ("code-edit", "chat"):
        off, ngram = (
            report["results"][workload]["off"],
            report["results"][workload]["ngram:k=2,min=1,max=2"],
        )
        assert off["proposed"] == 0 and off["acceptance"] is None
        assert 0 <= ngram["accepted"] <= ngram["proposed"]
        assert off["tok_per_s"] > 0 and ngram["tok_per_s"] > 0
        # Whether the answers agree is reported (the engine tests check that they do,
        # near-ties of a random model aside); "off" has nothing to agree with.
        assert off["same_tokens_as_off"] is True and isinstance(ngram["same_tokens_as_off"], bool)
        assert 1 <= off["output_tokens"] <= 12 and 1 <= ngram["output_tokens"] <= 12


def test_each_repetition_starts_with_a_proposer_that_forgot_the_last_answer(
    tmp_path: Path,
) -> None:
    """Suffix decoding keeps finished outputs for later requests; a repetition of the same
    request would be guessed from the previous one's answer and flatter the figure."""
    from kvserve.core.suffix_proposer import SuffixProposer
    from kvserve.engine import LLMEngine

    model_dir = save_tiny_model(
        tmp_path / "model", "llama", train_tiny_tokenizer(), max_position_embeddings=4096
    )
    engine = LLMEngine.from_engine_args(
        str(model_dir), block_size=4, speculative_config={"method": "suffix", "adaptive": False}
    )
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, SuffixProposer)
    stored_when_asked: list[int] = []
    propose = proposer.propose

    def recording(request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        stored_when_asked.append(len(proposer.cached_outputs))
        return propose(request_id, token_ids, num_tokens)

    proposer.propose = recording  # type: ignore[method-assign]
    prompt = spec.prompt_token_ids(engine, spec.WORKLOADS["chat"])[:40]
    first = spec.answer(engine, prompt, 12)
    assert list(proposer.cached_outputs.values()) == [first.token_ids]  # learnt at its end
    stored_when_asked.clear()
    spec.answer(engine, prompt, 12)
    assert stored_when_asked and set(stored_when_asked) == {0}  # but not used by the next
