"""``kvserve serve --trace FILE``: the engine loop's steps reach the file, closed at shutdown."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.cli import main
from kvserve.entrypoints.openai import uvicorn_server
from kvserve.trace import read_trace


def test_serve_traces_the_loop_s_steps_and_closes_the_file_on_shutdown(
    tiny_model_dir: Path,
    start_server: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace_path = tmp_path / "serve.jsonl"
    texts: list[str] = []

    def serve_one_request(app: Any, **options: Any) -> None:
        """Stands in for uvicorn_server.serve (uvicorn.run): a live server that answers one completion, then stops."""
        server = start_server(app)
        try:
            body = {"model": str(tiny_model_dir), "prompt": "The quick brown fox", "max_tokens": 4}
            body |= {"temperature": 0, "ignore_eos": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        finally:
            server.stop()

    monkeypatch.setattr(uvicorn_server, "serve", serve_one_request)
    flags = ["--model", str(tiny_model_dir), "--dtype", "float32", "--num-blocks", "64"]
    assert main(["serve", *flags, "--trace", str(trace_path)]) == 0
    assert len(texts) == 1
    # The steps came faster than the file flushes by itself (once a second): the last
    # ones reach it only when serve closes the file.
    (run,) = read_trace(trace_path)
    finished = [entry for step in run.steps for entry in step["finished"]]
    assert [(entry["reason"], entry["output_len"]) for entry in finished] == [("length", 4)]
    phases = [entry["phase"] for step in run.steps for entry in step["scheduled"]]
    assert phases == ["prefill", "decode", "decode", "decode"]
