"""The llama.cpp baseline of ``kvserve bench``: refused clearly without llama-cpp-python; with it
(the ``bench`` extra, which CI does not install), rows of exact token counts on the real model
whose greedy tokens agree with kvserve's."""

from __future__ import annotations

import json
import mmap
import os
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.benchmarks import common
from kvserve.benchmarks.baselines.llamacpp_baseline import (
    LlamaCppSetup,
    SingleStream,
    in_own_process,
    prepare_llamacpp,
)
from kvserve.benchmarks.baselines.llamacpp_batched import BatchedDecoder
from kvserve.benchmarks.common import cpu_info, machine_description
from kvserve.benchmarks.offline.sweep import sweep_table
from kvserve.cli import EXIT_USAGE, main
from kvserve.errors import ModelLoadError
from kvserve.kernels import huge_pages
from kvserve.loader import resolve_model
from model_fixtures import save_tiny_model, train_tiny_tokenizer

MODEL = "smollm2-135m-instruct"
SMALL_WORKLOADS = {
    "throughput": ["--num-requests", "3", "--input-len", "8", "16", "--output-len", "2", "5"],
    "latency": ["--prompt-lens", "16", "40", "--output-len", "4"],
    "sweep": ["--concurrency", "1", "2", "--input-len", "8", "16", "--output-len", "3"],
}


@pytest.mark.parametrize("mode", sorted(SMALL_WORKLOADS))
def test_without_llama_cpp_python_the_baseline_says_how_to_install_it(
    mode: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # ``import llama_cpp`` now fails
    model_dir = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    out = tmp_path / "result.json"
    argv = ["bench", mode, "--model", str(model_dir), *SMALL_WORKLOADS[mode]]
    argv += ["--repetitions", "1", "--baselines", "llamacpp", "--json", str(out)]
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "llama-cpp-python" in captured.err
    assert "make bench-deps" in captured.err
    assert "pip install -e '.[bench]'" in captured.err
    # Refused before anything was measured: nothing printed, nothing saved.
    assert captured.out == ""
    assert not out.exists()


def test_llama_cpp_is_measured_in_a_process_of_its_own() -> None:
    assert in_own_process(os.getpid) != os.getpid()
    assert in_own_process(max, 3, 7) == 7


def test_the_cpu_line_names_the_model_and_the_bf16_features() -> None:
    line = cpu_info().describe()
    family = f" ({cpu_info().family_model})" if cpu_info().family_model else ""
    assert line.startswith(f"CPU: {cpu_info().model}{family}, ")
    assert "AVX512_BF16: yes" in line or "AVX512_BF16: no" in line
    assert "AMX: yes" in line or "AMX: no" in line


def test_the_cpu_line_says_whether_the_weights_are_on_huge_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(common, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    assert (
        cpu_info()
        .describe()
        .endswith("weights on huge pages: no (transparent huge pages: madvise)")
    )
    assert machine_description()["weights_on_huge_pages"] is False
    monkeypatch.delenv(huge_pages.HUGE_PAGES_ENV)
    expected = "yes" if hasattr(mmap, "MADV_HUGEPAGE") else "no"
    assert (
        cpu_info()
        .describe()
        .endswith(f"weights on huge pages: {expected} (transparent huge pages: madvise)")
    )


def test_the_sweep_table_puts_llama_cpp_beside_kvserve_with_the_ratio() -> None:
    metrics = {
        "ms_per_token_per_seq": 10.0,
        "ttft_s": 0.1,
        "peak_rss_gib": 1.0,
        "decode_step_gflops": 5.0,
        "model_gflops": 6.0,
    }
    ours = {
        1: {**metrics, "output_tok_per_s": 30.0, "decode_tok_per_s": 90.0},
        2: {**metrics, "output_tok_per_s": 50.0, "decode_tok_per_s": 120.0},
    }
    theirs = {
        1: {**metrics, "output_tok_per_s": 20.0, "decode_tok_per_s": 30.0},
        2: {**metrics, "output_tok_per_s": 25.0, "decode_tok_per_s": 80.0},
    }
    rendered = sweep_table(ours, theirs).render().splitlines()
    assert rendered[0].split()[-6:] == ["ms", "vs", "llama.cpp", "decode", "vs", "llama.cpp"]
    rows = [line.split() for line in rendered[2:]]
    assert [(row[0], row[1]) for row in rows] == [
        ("1", "kvserve"),
        ("1", "llamacpp"),
        ("2", "kvserve"),
        ("2", "llamacpp"),
    ]
    # Output tok/s over the whole workload, then the decode-only rate.
    assert rows[0][-2:] == ["1.50x", "3.00x"]
    assert rows[2][-2:] == ["2.00x", "1.50x"]
    # Without llama.cpp results the table has no ratio column.
    assert "llama.cpp" not in sweep_table(ours, {}).render()


# Everything below runs llama.cpp itself on the real SmolLM2.


@pytest.fixture(scope="module")
def llama_cpp_setup() -> LlamaCppSetup:
    pytest.importorskip("llama_cpp")
    try:
        resolve_model(MODEL)
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    return prepare_llamacpp(MODEL, "bf16")


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(SMALL_WORKLOADS))
def test_each_bench_prints_and_saves_a_llama_cpp_row(
    mode: str, llama_cpp_setup: LlamaCppSetup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["bench", mode, "--model", MODEL, *SMALL_WORKLOADS[mode], "--repetitions", "1"]
    argv += ["--baselines", "llamacpp", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("CPU: ")
    # By default llama.cpp runs the file kvserve loads, as stored.
    assert "llama.cpp (llama-cpp-python" in printed and "SmolLM2-135M-Instruct.Q4_1.gguf" in printed
    assert "llama.cpp" in printed.split("\n", 1)[1]  # the ratio column
    report = json.loads(out.read_text())
    assert report["llamacpp"]["weights"] == "source"
    assert "avx512_bf16" in report["machine"]
    if mode == "throughput":
        results = report["results"]
        assert set(results) == {"kvserve", "llamacpp"}
        output_tokens = results["kvserve"]["output_tok_per_s"] * results["kvserve"]["wall_s"]
        # Both systems produce the workload's exact output tokens.
        for metrics in results.values():
            assert metrics["output_tok_per_s"] * metrics["wall_s"] == pytest.approx(output_tokens)
            assert metrics["requests_per_s"] * metrics["wall_s"] == pytest.approx(3)
    elif mode == "latency":
        assert set(report["results"]["llamacpp"]) == {"16", "40"}
        for metrics in report["results"]["llamacpp"].values():
            assert metrics["ttft_s"] > 0 and metrics["ms_per_token"] > 0
    else:
        results = report["llamacpp"]["results"]
        assert set(results) == {"1", "2"}
        for metrics in results.values():
            assert metrics["output_tok_per_s"] > 0 and metrics["ms_per_token_per_seq"] > 0


@pytest.mark.slow
def test_batched_decode_gives_every_request_its_exact_output_length(
    llama_cpp_setup: LlamaCppSetup,
) -> None:
    prompts = [list(range(100, 100 + n)) for n in (5, 9, 3, 7)]
    output_lens = [6, 1, 4, 3]
    # Two sequence ids for four requests: finished sequences hand theirs on.
    with BatchedDecoder(llama_cpp_setup, 2, 16, 9) as decoder:
        run = decoder.run(prompts, output_lens)
        again = decoder.run(prompts, output_lens)
    assert [len(tokens) for tokens in run.output_token_ids] == output_lens
    assert [len(trace.token_times) for trace in run.result.traces] == output_lens
    assert run.result.output_tokens() == sum(output_lens)
    # Each run starts from an empty KV cache: the same greedy tokens again.
    assert again.output_token_ids == run.output_token_ids
    # Decode-only steps ran at most two sequences, each attending to its prompt and outputs.
    assert run.result.decode_steps
    assert all(1 <= len(step.context_lens) <= 2 for step in run.result.decode_steps)


@pytest.mark.slow
def test_llama_cpp_greedy_tokens_mostly_agree_with_kvserve_float32(
    llama_cpp_setup: LlamaCppSetup,
) -> None:
    num_tokens = 8
    llm = LLM(MODEL, dtype="float32")
    tokenizer = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of",
        "The three primary colors are",
    ]
    prompts = [tokenizer.encode(text) for text in texts]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [list(output.outputs[0].token_ids) for output in outputs]
    del llm
    with SingleStream(llama_cpp_setup, 64) as stream:
        single = [stream.generate(p, num_tokens).token_ids for p in prompts]
    with BatchedDecoder(llama_cpp_setup, len(prompts), 64, 16) as decoder:
        batched = decoder.run(prompts, [num_tokens] * len(prompts)).output_token_ids
    for theirs in (single, batched):
        assert [len(tokens) for tokens in theirs] == [num_tokens] * len(prompts)
        # bf16 weights against float32: a near tie may flip a token and the text then drifts,
        # so ask for most first tokens and most positions, not all.
        same_first = sum(a[0] == b[0] for a, b in zip(ours, theirs, strict=True))
        same = sum(
            x == y for a, b in zip(ours, theirs, strict=True) for x, y in zip(a, b, strict=True)
        )
        assert same_first >= len(prompts) - 1, (ours, theirs)
        assert same >= 0.6 * num_tokens * len(prompts), (ours, theirs)
