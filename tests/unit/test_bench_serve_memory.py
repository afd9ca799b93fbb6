"""``kvserve bench serve-memory``: each server started, loaded, stopped, its resident memory read.

The servers are stood in for by a small Python server that holds a chosen
amount of memory (and a child process holding more), so the figures have a
known lower bound; ``/proc`` is real.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.benchmarks.baselines import llamacpp_tools
from kvserve.benchmarks.online import serve_memory
from kvserve.benchmarks.online.process_memory import (
    parent_pid,
    parse_status,
    process_memory,
    process_tree,
)
from kvserve.benchmarks.online.serve_client import ServerError
from kvserve.benchmarks.online.serve_memory import Load, free_port, measure_server
from kvserve.benchmarks.workloads.shaped_gguf import write_shaped_gguf
from kvserve.cli import EXIT_USAGE, main

MIB = 1024**2

# argv: PORT HOLD_MIB CHILD_MIB [exit]. Answers /health, /v1/models and streamed completions.
FAKE_SERVER = r"""
import json, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, hold_mib, child_mib = (int(a) for a in sys.argv[1:4])
if sys.argv[4:] == ["exit"]:
    print("cannot load the model", flush=True)
    sys.exit(7)
held = b"\x01" * (hold_mib << 20)  # written, so resident
child = subprocess.Popen([sys.executable, "-c",
    f"import time; x = b'\\x01' * ({child_mib} << 20); time.sleep(3600)"])

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def reply(self, body, content_type="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            self.reply(b"{}")
        else:
            self.reply(json.dumps({"data": [{"id": "fake-model"}]}).encode())
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert request["model"] == "fake-model" and request["ignore_eos"]
        events = [{"choices": [{"text": "x", "index": 0}]}] * request["max_tokens"]
        events.append({"choices": [], "usage": {"completion_tokens": request["max_tokens"]}})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.reply(body.encode(), "text/event-stream")

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

LOAD = Load(
    num_requests=6,
    concurrency=2,
    max_tokens=5,
    prompt_tokens=20,
    seed=0,
    start_timeout_s=60,
    request_timeout_s=30,
)


def fake_command(folder: Path, port: int, hold_mib: int, child_mib: int, *extra: str) -> list[str]:
    script = folder / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return [sys.executable, str(script), str(port), str(hold_mib), str(child_mib), *extra]


def test_status_and_stat_lines_are_read_as_the_kernel_writes_them() -> None:
    status = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t4\n"
    assert parse_status(status) == (100 * MIB, 200 * MIB)
    assert parse_status("Name:\tkthreadd\nThreads:\t1\n") is None  # a kernel thread
    # A process may name itself anything, parentheses and spaces included.
    assert parent_pid("1234 (a) b (c) S 77 1234 1234 0 -1") == 77


def test_the_process_tree_holds_children_and_their_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        assert child.pid in process_tree(os.getpid())
        assert os.getpid() not in process_tree(child.pid)
        mine = process_memory(os.getpid())
        assert mine is not None and mine.hwm_bytes >= mine.rss_bytes > 0
    finally:
        child.kill()
        child.wait()


def test_a_server_is_loaded_and_its_peak_memory_read(tmp_path: Path) -> None:
    port = free_port()
    command = fake_command(tmp_path, port, 120, 60)
    result = asyncio.run(measure_server("fake", command, port, LOAD))
    assert result.num_failed == 0 and result.output_tokens_per_s > 0
    assert result.command == command and result.ready_s > 0
    # The server's own peak holds what it wrote; the tree's peak adds its child's.
    assert result.hwm_bytes >= 120 * MIB
    assert result.rss_after_load_bytes >= 120 * MIB
    assert result.tree_peak_rss_bytes >= 180 * MIB
    # Stopped: nothing of the server's process group is left.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(ServerError, match=r"exited with 7 before it was ready(.|\n)*cannot load"):
        asyncio.run(measure_server("fake", fake_command(tmp_path, port, 1, 1, "exit"), port, LOAD))


def test_bench_serve_memory_compares_kvserve_with_llama_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "tiny.gguf"
    write_shaped_gguf("tiny-llama", model)
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("llama-bench", "llama-server"):
        (tools / name).touch()
    monkeypatch.setattr(llamacpp_tools, "tools_dir", lambda level: tools)
    served: dict[str, str] = {}

    def kvserve(model_arg: str, port: int, extra: list[str]) -> list[str]:
        served["kvserve"] = model_arg
        return fake_command(tmp_path, port, 40, 10)

    def llama_server(run: llamacpp_tools.ToolRun, port: int, extra: list[str]) -> list[str]:
        served["llama-server"] = str(run.model_file)
        assert extra == ["-c", "4096"]
        return fake_command(tmp_path, port, 200, 10)

    monkeypatch.setattr(serve_memory, "kvserve_command", kvserve)
    monkeypatch.setattr(serve_memory, "llama_server_command", llama_server)
    out = tmp_path / "memory.json"
    argv = ["bench", "serve-memory", "--model", str(model), "--num-requests", "4"]
    argv += ["--max-tokens", "3", "--llama-server-args", "-c 4096", "--json", str(out)]
    assert main(argv) == 0
    # The same file for both, as stored.
    assert served == {"kvserve": str(model), "llama-server": str(model)}
    report = json.loads(out.read_text())
    kv, llama = report["results"]
    assert (kv["server"], llama["server"]) == ("kvserve", "llama-server")
    assert kv["hwm_bytes"] < llama["hwm_bytes"] and llama["hwm_bytes"] >= 200 * MIB
    printed = capsys.readouterr().out.splitlines()
    row = next(line for line in printed if line.split()[:1] == ["kvserve"])
    expected_peak = kv["tree_peak_rss_bytes"] / llama["tree_peak_rss_bytes"]
    expected_hwm = kv["hwm_bytes"] / llama["hwm_bytes"]
    assert row.split()[-2:] == [f"{expected_peak:.2f}x", f"{expected_hwm:.2f}x"]


def test_bad_load_values_are_refused_before_any_server_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "serve-memory", "--model", "m.gguf", "--num-requests", "0"]
    assert main(argv) == EXIT_USAGE
    assert "num_requests" in capsys.readouterr().err


def test_a_build_without_llama_server_is_refused_before_any_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "tiny.gguf"
    write_shaped_gguf("tiny-llama", model)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-bench").touch()
    monkeypatch.setattr(llamacpp_tools, "tools_dir", lambda level: tmp_path / "bin")
    started: list[str] = []
    monkeypatch.setattr(serve_memory, "kvserve_command", lambda *a: started.append("kvserve"))
    assert main(["bench", "serve-memory", "--model", str(model)]) == EXIT_USAGE
    assert "llama-server is missing" in capsys.readouterr().err
    assert started == []
