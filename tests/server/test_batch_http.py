"""The Ray Data batch job's HTTP replica against a live server, without Ray.

``HTTPGenerator`` is what each Ray actor runs when a job posts to a running
``kvserve serve``; here it gets a batch directly. Its texts must be what a
plain in-process ``LLM`` generates for each prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvserve import LLM, SamplingParams
from kvserve.batch.ray_data import HTTPGenerator

SAMPLING: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def test_http_replica_returns_each_prompts_own_completion(
    tiny_model_dir: Path, start_tiny_server: Callable[..., Any]
) -> None:
    server = start_tiny_server()
    prompts = ["alpha beta", "gamma delta kv cache", "ray", "block block block"]
    batch = {"id": np.arange(len(prompts)), "prompt": np.array(prompts, dtype=object)}
    generator = HTTPGenerator(server.url, "tiny", SAMPLING, num_threads=3)
    out = generator(batch)
    assert out["id"].tolist() == list(range(len(prompts)))
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_blocks=512, max_model_len=256)
    params = SamplingParams(**SAMPLING)
    for prompt, text, reason in zip(prompts, out["text"], out["finish_reason"], strict=True):
        (alone,) = llm.generate(prompt, params, use_tqdm=False)
        assert text == alone.outputs[0].text
        assert reason == "length"
