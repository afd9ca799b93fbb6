"""``kvserve bench dashboard`` against a live kvserve server on the tiny model: a smoke run.

The real measurement (50 clients, SmolLM2) is a benchmark, not a test; this
checks that both settings run, every request generates its tokens, the
reading clients get frames, and the silent ones are let go afterwards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_faults import slow_down

from kvserve.benchmarks.online.dashboard_clients import events_url
from kvserve.cli import main

API_KEY = "bench-dashboard-key"


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    server = start_tiny_server(api_keys=(API_KEY,))
    # The tiny model would finish a run before the first frame (at most ten a second)
    # on a fast machine: 10 ms a step makes each run last about a second.
    slow_down(server, 0.01)
    return server


def test_both_settings_run_and_the_clients_get_frames(server: Any, tmp_path: Path) -> None:
    path = tmp_path / "dashboard.json"
    argv = ["bench", "dashboard", "--base-url", f"{server.url}/v1", "--api-key", API_KEY]
    workload = ["--num-requests", "6", "--concurrency", "2", "--max-tokens", "32"]
    clients = ["--clients", "6", "--silent-clients", "2", "--repetitions", "2"]
    flags = ["--prompt-tokens", "8", "--timeout", "60", "--max-slowdown", "0.99"]
    code = main([*argv, *workload, *clients, *flags, "--json", str(path)])
    report = json.loads(path.read_text())
    assert code == 0, report
    assert report["benchmark"] == "dashboard" and report["args"]["api_key"] == "(set)"
    runs = report["runs"]
    assert [run["clients"] for run in runs] == [0, 6, 6, 0]  # alternating order
    for run in runs:
        assert run["num_failed"] == 0 and run["output_tok_s"] > 0
    assert all(run["frames_per_client_s"] > 0 for run in runs if run["clients"])
    hub = server.app.state.dashboard.hub
    deadline = time.monotonic() + 10
    while hub.num_clients:  # the silent clients' connections were closed too
        assert time.monotonic() < deadline, f"{hub.num_clients} clients left behind"
        time.sleep(0.05)
    server.wait_idle()


@pytest.mark.parametrize(
    ("base_url", "expected"),
    [
        ("http://h:1/v1", "http://h:1/dashboard/events"),
        ("http://h:1/v1/", "http://h:1/dashboard/events"),
        ("http://h:1", "http://h:1/dashboard/events"),
    ],
)
def test_the_stream_is_found_beside_the_api_root(base_url: str, expected: str) -> None:
    assert events_url(base_url) == expected


def test_bad_values_are_refused_before_anything_is_sent(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "dashboard", "--base-url", "http://127.0.0.1:9/v1"]
    assert main([*argv, "--clients", "4", "--silent-clients", "5"]) == 2
    assert "silent_clients" in capsys.readouterr().err
