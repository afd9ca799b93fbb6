"""``kvserve bench serve`` against a live kvserve server on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.cli import main

API_KEY = "bench-serve-key"
NUM_REQUESTS = 6
MAX_TOKENS = 5
# Small prompts: the tiny model's context is 256 tokens, and its tokenizer
# spends several tokens on a word.
SMALL = ["--prompt-tokens", "8", "--shared-prefix-tokens", "24", "--timeout", "60"]


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    return start_tiny_server()


@pytest.fixture(scope="module")
def key_server(start_tiny_server: Any) -> Any:
    return start_tiny_server(api_keys=(API_KEY,))


def bench(url: str, json_path: Path | None, *flags: str) -> int:
    argv = ["bench", "serve", "--base-url", f"{url}/v1", *SMALL, *flags]
    return main([*argv, "--json", str(json_path)] if json_path else argv)


def workload(num_requests: int = NUM_REQUESTS) -> list[str]:
    return ["--num-requests", str(num_requests), "--max-tokens", str(MAX_TOKENS)]


@pytest.mark.parametrize(
    ("endpoint", "kind"), [("chat", "distinct"), ("completions", "shared-prefix")]
)
def test_every_request_generates_max_tokens_and_the_report_says_so(
    server: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    endpoint: str,
    kind: str,
) -> None:
    path = tmp_path / "serve.json"
    flags = ["--endpoint", endpoint, "--prompt-kind", kind, "--concurrency", "3"]
    assert bench(server.url, path, *workload(), *flags, "--warmup", "1", "--seed", "7") == 0
    server.wait_idle()  # every stream was read to its end: nothing left running

    report = json.loads(path.read_text())
    assert report["benchmark"] == "serve"
    assert report["model"] == "tiny"  # from GET /v1/models
    assert report["args"]["endpoint"] == endpoint and report["args"]["prompt_kind"] == kind
    assert report["args"]["seed"] == 7 and report["args"]["num_requests"] == NUM_REQUESTS
    assert report["expected_output_tokens"] == NUM_REQUESTS * MAX_TOKENS
    assert (report["num_failed"], report["first_error"]) == (0, None)
    assert len(report["runs"]) == 1
    median = report["median"]
    assert median["output_tokens"] == NUM_REQUESTS * MAX_TOKENS
    assert median["num_succeeded"] == median["num_counted_by_usage"] == NUM_REQUESTS
    assert median["output_tokens_per_s"] == pytest.approx(
        median["output_tokens"] / median["wall_s"]
    )
    assert median["requests_per_s"] == pytest.approx(NUM_REQUESTS / median["wall_s"])
    for name in ("ttft", "itl"):
        p50, p90, p99 = (median[f"{name}_p{q}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99 < 1000 * median["wall_s"]
    assert 0 < median["gap_p50_ms"] <= median["gap_p99_ms"] <= median["gap_max_ms"]

    out = capsys.readouterr().out
    assert "TTFT" in out and "chunk gap" in out
    assert f"{NUM_REQUESTS * MAX_TOKENS} output tokens (counted from the server's usage)" in out


def prefix_hits_of_a_run(server: Any, kind: str) -> int:
    stats = lambda: server.async_engine.engine.stats  # noqa: E731
    before = stats().prefix_cache_hits
    flags = ["--prompt-kind", kind, "--concurrency", "1", "--warmup", "0"]
    assert bench(server.url, None, *workload(4), *flags, "--seed", "11") == 0
    return int(stats().prefix_cache_hits - before)


def test_shared_prefix_prompts_reach_the_server_with_one_shared_prefix(server: Any) -> None:
    # One at a time, each request after the first finds the system prompt cached:
    # at least its ~21 words, so 20 tokens in full 4-token blocks.
    shared = prefix_hits_of_a_run(server, "shared-prefix")
    assert shared >= 3 * 20
    distinct = prefix_hits_of_a_run(server, "distinct")
    assert distinct < shared / 3


def test_a_wrong_model_name_is_reported_as_failed_requests(
    server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "serve.json"
    assert bench(server.url, path, *workload(3), "--model", "nope", "--warmup", "1") == 1
    report = json.loads(path.read_text())
    assert report["num_failed"] == 3 and report["median"]["num_succeeded"] == 0
    assert report["median"]["output_tokens"] == 0
    assert report["first_error"].startswith("HTTP 400: The model 'nope' does not exist")
    out = capsys.readouterr().out
    assert "3 of 3 requests failed; first error: HTTP 400: The model 'nope'" in out


def test_a_bad_api_key_fails_the_requests_and_the_right_one_works(
    key_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "serve.json"
    wrong = ["--api-key", "wrong", "--warmup", "0"]
    assert bench(key_server.url, path, *workload(2), *wrong, "--model", "tiny") == 1
    report = json.loads(path.read_text())
    assert report["num_failed"] == 2
    assert report["first_error"].startswith("HTTP 401: ")

    # Without --model, the model list is the first thing refused: a clear error, no report.
    capsys.readouterr()
    assert bench(key_server.url, None, *workload(2), *wrong) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: GET {key_server.url}/v1/models: HTTP 401: ")

    assert bench(key_server.url, path, *workload(2), "--api-key", API_KEY, "--warmup", "0") == 0
    report = json.loads(path.read_text())
    assert report["median"]["output_tokens"] == 2 * MAX_TOKENS
    assert report["args"]["api_key"] == "(set)" and API_KEY not in path.read_text()


def test_an_unreachable_server_is_an_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Port 9 (discard) on loopback: nothing listens there.
    assert bench("http://127.0.0.1:9", None, *workload(2)) == 1
    assert capsys.readouterr().err.startswith("error: GET http://127.0.0.1:9/v1/models: Connect")
    assert bench("http://127.0.0.1:9", None, *workload(2), "--model", "m", "--warmup", "0") == 1
    assert "2 of 2 requests failed; first error: ConnectError" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value", "param"),
    [
        ("--num-requests", "0", "num_requests"),
        ("--concurrency", "0", "concurrency"),
        ("--timeout", "0", "timeout"),
        ("--base-url", "127.0.0.1:8000/v1", "base_url"),
    ],
)
def test_bad_values_are_refused_before_anything_is_sent(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, param: str
) -> None:
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9/v1", flag, value]) == 2
    assert capsys.readouterr().err.startswith(f"error: {param}: ")
