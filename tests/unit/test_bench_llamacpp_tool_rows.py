"""llama.cpp's tool rows in ``kvserve bench latency`` and ``sweep``: the same file kvserve loads.

``llama-bench`` and ``llama-batched-bench`` are stood in for by small Python
scripts that answer what the real tools answer (the tools come from ``make
bench-deps``, minutes of compiling); they record the file they were given.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
from pathlib import Path

import pytest

from kvserve.benchmarks.baselines import llamacpp_tools
from kvserve.benchmarks.baselines.llamacpp_tools import prepare_tool_run
from kvserve.benchmarks.offline import latency, sweep
from kvserve.benchmarks.workloads.shaped_gguf import write_shaped_gguf
from kvserve.cli import build_parser, main
from kvserve.errors import ModelLoadError
from model_fixtures import save_tiny_model, train_tiny_tokenizer

# Prompt rate 1000 tok/s whatever the length; decode 100 tok/s at every depth.
FAKE_LLAMA_BENCH = """
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
open(sys.argv[0] + ".models", "a").write(args["-m"] + "\\n")
p, n = int(args["-p"]), int(args["-n"])
depths = [int(d) for d in args["-d"].split(",")]
rate = 1000.0 if n == 0 else 100.0
print(json.dumps([
    {"n_prompt": p, "n_gen": n, "n_depth": d, "samples_ts": [rate, rate * 0.9, rate * 1.1]}
    for d in depths
]))
"""

# S_TG of 40 tok/s per sequence.
FAKE_BATCHED_BENCH = """
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
open(sys.argv[0] + ".models", "a").write(args["-m"] + "\\n")
for pl in args["-npl"].split(","):
    print(json.dumps({"pp": int(args["-npp"]), "tg": int(args["-ntg"]), "pl": int(pl),
                      "speed_pp": 500.0, "speed_tg": 40.0 * int(pl)}))
"""


def fake_tools(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Both tools as Python scripts in ``folder``, which becomes every level's build."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in (
        ("llama-bench", FAKE_LLAMA_BENCH),
        ("llama-batched-bench", FAKE_BATCHED_BENCH),
    ):
        script = folder / name
        script.write_text(f"#!{sys.executable}\n{body}")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(llamacpp_tools, "tools_dir", lambda level: folder)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.bf16.gguf"
    write_shaped_gguf("tiny-llama", path)
    return path


@pytest.mark.parametrize("mode", ["latency", "sweep", "throughput"])
def test_llama_cpp_runs_the_file_as_stored_by_default(mode: str) -> None:
    args = build_parser().parse_args(["bench", mode, "--model", "m.gguf"])
    assert args.llamacpp_weights == "source"
    args = build_parser().parse_args(
        ["bench", mode, "--model", "m.gguf", "--llamacpp-weights", "bf16"]
    )
    assert args.llamacpp_weights == "bf16"


def test_the_tool_run_is_the_file_kvserve_loads(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = fake_tools(tmp_path / "bin", monkeypatch)
    run = prepare_tool_run(str(tiny_gguf), "source")
    assert run.model_file == tiny_gguf and run.build.folder == tools
    assert run.as_json()["model_file"] == str(tiny_gguf)
    assert "as stored" in run.describe("llama-bench")
    # llama.cpp reads GGUF only: a Hugging Face folder is refused before anything runs.
    folder = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    with pytest.raises(ModelLoadError, match="needs a GGUF model"):
        prepare_tool_run(str(folder), "source")


def test_the_latency_table_gives_kvserves_decode_and_ttft_over_llama_bench() -> None:
    results = {
        "hf_generate": {},
        "kvserve": {128: {"ttft_s": 0.05, "ms_per_token": 10.0}},
        "llama-bench": {128: {"ttft_s": 0.10, "ms_per_token": 15.0}},
    }
    rendered = latency.latency_table(results).render().splitlines()
    assert "decode vs llama-bench" in rendered[0] and "TTFT vs llama-bench" in rendered[0]
    assert "vs HF" not in rendered[0]  # transformers did not run
    kvserve_row, tool_row = rendered[2].split(), rendered[3].split()
    assert kvserve_row[:2] == ["128", "kvserve"] and kvserve_row[-2:] == ["1.50x", "2.00x"]
    assert tool_row[:2] == ["128", "llama-bench"] and "x" not in "".join(tool_row[2:])


def test_bench_latency_prints_llama_bench_rows_on_the_same_file(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tools = fake_tools(tmp_path / "bin", monkeypatch)
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(tiny_gguf), "--prompt-lens", "16", "24"]
    argv += ["--output-len", "4", "--repetitions", "1", "--baselines", "llama-bench"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"runs {tiny_gguf} (the model's file as stored" in printed
    # Every llama-bench call ran kvserve's own file.
    assert set((tools / "llama-bench.models").read_text().split()) == {str(tiny_gguf)}
    report = json.loads(out.read_text())
    tool = report["results"]["llama-bench"]
    assert tool["16"] == {"ttft_s": pytest.approx(0.016), "ms_per_token": pytest.approx(10.0)}
    assert tool["24"]["ttft_s"] == pytest.approx(0.024)
    assert report["llama-bench"]["model_file"] == str(tiny_gguf)
    assert report["llama-bench"]["weights"] == "source"
    ours = report["results"]["kvserve"]["24"]
    row = next(line for line in printed.splitlines() if line.split()[:2] == ["24", "kvserve"])
    assert row.split()[-2:] == [
        f"{10.0 / ours['ms_per_token']:.2f}x",
        f"{0.024 / ours['ttft_s']:.2f}x",
    ]


def test_bench_sweep_s_tg_beside_kvserve_with_the_ratio(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = fake_tools(tmp_path / "bin", monkeypatch)
    run = prepare_tool_run(str(tiny_gguf), "source")
    args = argparse.Namespace(input_len=(100, 156), output_len=32, concurrency=[16, 64])
    args.repetitions = 3
    rates = sweep.measure_batched_bench(args, run)
    assert rates == {16: 640.0, 64: 2560.0}
    assert (tools / "llama-batched-bench.models").read_text().split() == [str(tiny_gguf)] * 3
    results = {16: {"decode_tok_per_s": 960.0}, 64: {"decode_tok_per_s": 1280.0}}
    rendered = sweep.batched_bench_table(results, rates, args).render().splitlines()
    assert [line.split() for line in rendered[2:]] == [
        ["16", "960.0", "640.0", "1.50x"],
        ["64", "1,280.0", "2,560.0", "0.50x"],
    ]


def test_bench_latency_takes_turns_with_llama_bench(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_tools(tmp_path / "bin", monkeypatch)
    events: list[str] = []
    measure, bench = latency.kvserve_latency, latency.llama_bench

    def kvserve_turn(engine: object, prompt: list[int], output_len: int) -> dict[str, float]:
        events.append(f"kvserve {len(prompt)}")
        return measure(engine, prompt, output_len)

    def bench_turn(*args: object, **kwargs: object) -> list[object]:
        events.append(f"llama-bench r{args[3]}")
        return bench(*args, **kwargs)

    monkeypatch.setattr(latency, "kvserve_latency", kvserve_turn)
    monkeypatch.setattr(latency, "llama_bench", bench_turn)
    argv = ["bench", "latency", "--model", str(tiny_gguf), "--prompt-lens", "16", "24"]
    argv += ["--output-len", "4", "--repetitions", "2", "--baselines", "llama-bench"]
    assert main(argv) == 0
    turn = ["kvserve 16", "kvserve 24"] + ["llama-bench r1"] * 3  # pp16, pp24, then tg at depths
    warmup = "kvserve 16"  # the first prompt's first 32 tokens (all 16 here)
    assert events == [warmup, *turn, *turn]  # after a warm-up, one repetition each in turn
    events.clear()
    assert main([*argv, "--no-interleave"]) == 0
    kvserve_first = [warmup, "kvserve 16", "kvserve 16", warmup, "kvserve 24", "kvserve 24"]
    assert events == kvserve_first + ["llama-bench r2"] * 3
