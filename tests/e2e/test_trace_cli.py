"""``--trace FILE`` on the commands that run an engine, and ``kvserve trace FILE --chrome``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser, main
from kvserve.trace import read_trace
from model_fixtures import save_tiny_model, train_tiny_tokenizer

PROMPTS = ["The quick brown fox", "Paged attention stores keys"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


def model_flags(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32"]


def test_generate_writes_a_trace_of_every_prompt_and_prints_the_same_text(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_path = tmp_path / "generate.jsonl"
    flags = ["--temperature", "0", "--max-tokens", "5", "--ignore-eos", "--trace", str(trace_path)]
    assert main(["generate", *PROMPTS, *model_flags(model_dir), *flags]) == 0
    printed = capsys.readouterr().out
    reference = LLM(str(model_dir), dtype="float32").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    for output in reference:
        assert output.outputs[0].text in printed
    (run,) = read_trace(trace_path)
    assert run.header["model"] == str(model_dir)
    finished = [entry for step in run.steps for entry in step["finished"]]
    assert sorted(entry["prompt_len"] for entry in finished) == sorted(
        len(output.prompt_token_ids) for output in reference
    )
    assert all(entry["output_len"] == 5 for entry in finished)

    chrome_path = tmp_path / "generate.json"
    assert main(["trace", str(trace_path), "--chrome", str(chrome_path)]) == 0
    assert "2 requests, 2 finished" in capsys.readouterr().out
    events = json.loads(chrome_path.read_text(encoding="utf-8"))["traceEvents"]
    tracks = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert tracks == ["engine steps", "request offline-0", "request offline-1"]


def test_a_bench_comparing_two_engines_writes_one_run_each(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_path = tmp_path / "chunked.jsonl"
    sizes = ["--num-decoding", "2", "--decode-output-len", "6", "--num-long", "1"]
    sizes += ["--long-prompt-len", "40", "--arrival-every", "2", "--chunk-budget", "16"]
    sizes += ["--repetitions", "1", "--max-num-seqs", "4"]
    flags = [*model_flags(model_dir), *sizes, "--trace", str(trace_path)]
    assert main(["bench", "chunked-prefill", *flags]) == 0
    capsys.readouterr()
    runs = read_trace(trace_path)
    assert [run.header["enable_chunked_prefill"] for run in runs] == [True, False]
    chunked, unchunked = runs
    assert max(step["num_tokens"] for step in chunked.steps) <= 16
    partial = [e for s in chunked.steps for e in s["scheduled"] if e["partial"]]
    assert partial and not [e for s in unchunked.steps for e in s["scheduled"] if e["partial"]]


def test_bench_prefix_traces_both_engines_in_one_file(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_path = tmp_path / "prefix.jsonl"
    sizes = ["--num-requests", "2", "--prefix-len", "16", "--question-len", "4"]
    sizes += ["--output-len", "3", "--repeats", "1", "--max-num-seqs", "4"]
    flags = [*model_flags(model_dir), *sizes, "--trace", str(trace_path)]
    assert main(["bench", "prefix", *flags]) == 0
    capsys.readouterr()
    runs = read_trace(trace_path)
    assert [run.header["enable_prefix_caching"] for run in runs] == [False, True]
    # With the cache on, the second request starts past the shared prefix.
    starts = [e["start"] for s in runs[1].steps for e in s["scheduled"] if e["phase"] == "prefill"]
    assert max(starts) >= 16


@pytest.mark.parametrize("mode", ["throughput", "latency", "sweep", "chunked-prefill", "prefix"])
def test_every_in_process_bench_takes_trace(mode: str) -> None:
    args = build_parser().parse_args(["bench", mode, "--trace", "out.jsonl"])
    assert args.trace == Path("out.jsonl")


def test_a_trace_path_that_cannot_be_written_is_a_usage_error(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "missing-dir" / "t.jsonl"
    assert main(["generate", "hi", *model_flags(model_dir), "--trace", str(bad)]) == 2
    assert "error: trace: cannot write" in capsys.readouterr().err
