"""``kvserve bench soak`` for a few seconds against a live server on the tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvserve.entrypoints.cli import main

# The tiny model's context is 256 tokens and its tokenizer spends several on a word.
SMALL = ["--max-tokens", "4", "--long-max-tokens", "48", "--prompt-words", "4"]


def test_a_short_soak_passes_and_leaves_every_block_free(
    start_tiny_server: Any, tmp_path: Path
) -> None:
    # 64 blocks of 4 tokens: one preempting request (n=4, 48 tokens each) does not fit.
    server = start_tiny_server(engine_args={"num_blocks": 64}, max_request_body_bytes=64 * 1024)
    path = tmp_path / "soak.json"
    argv = ["bench", "soak", "--base-url", f"{server.url}/v1", *SMALL, "--concurrency", "3"]
    argv += ["--duration", "3", "--warmup", "1", "--rss-interval", "0.2"]
    # The server runs in this process: its memory is this process's.
    argv += ["--server-pid", str(os.getpid()), "--oversized-bytes", str(128 * 1024)]
    assert main([*argv, "--json", str(path)]) == 0

    report = json.loads(path.read_text())
    assert report["benchmark"] == "soak" and report["passed"] is True, report["problems"]
    assert report["requests"] > 0 and report["valid_5xx"] == 0 and report["unexpected"] == 0
    assert report["kv_blocks_used_end"] == 0 and report["sequences_held_end"] == 0
    assert report["preemptions"] is not None and report["rss"]["num_samples"] > 0
    server.wait_idle()
