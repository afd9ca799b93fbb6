"""The embedding benchmark's baselines: sentence-transformers and llama-server ``--embeddings``.

Each returns its median sentences per second and the vectors of the first
sentences, which the benchmark compares with kvserve's. sentence-transformers
runs in a process of its own (PyTorch's threads set to kvserve's count, no
OpenMP workers left over from kvserve's run); llama-server is its own process.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvserve.benchmarks.baselines.bert_gguf import bert_gguf
from kvserve.benchmarks.baselines.llamacpp_baseline import in_own_process
from kvserve.benchmarks.baselines.llamacpp_tools import tool_build
from kvserve.benchmarks.common import Metrics, median_metrics
from kvserve.benchmarks.online.serve_memory import free_port, server_process, wait_ready
from kvserve.loader import ModelSource

NUM_COMPARED = 64


def measure_sentence_transformers(
    folder: str, sentences: list[str], threads: int, batch_size: int, repetitions: int
) -> tuple[Metrics, np.ndarray]:
    """sentence-transformers ``encode`` on ``folder`` in float32, in its own process."""
    result: tuple[Metrics, np.ndarray] = in_own_process(
        _sentence_transformers_run, folder, sentences, threads, batch_size, repetitions
    )
    return result


def _sentence_transformers_run(
    folder: str, sentences: list[str], threads: int, batch_size: int, repetitions: int
) -> tuple[Metrics, np.ndarray]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(folder, device="cpu")

    def encode(texts: list[str]) -> Any:
        with torch.inference_mode():
            return model.encode(texts, batch_size=batch_size, show_progress_bar=False)

    return _timed_embeddings(encode, sentences, repetitions)


def _timed_embeddings(
    embed: Callable[[list[str]], Any], sentences: list[str], repetitions: int
) -> tuple[Metrics, np.ndarray]:
    """Sentences per second of ``embed`` over ``sentences`` (median of ``repetitions``, after
    a warm-up), and its vectors of the first :data:`NUM_COMPARED` for the cosine check."""

    def timed() -> Metrics:
        started = time.perf_counter()
        embed(sentences)
        elapsed = time.perf_counter() - started
        return {"sentences_per_s": len(sentences) / elapsed, "seconds": elapsed}

    metrics, _ = median_metrics(timed, repetitions, warmup=lambda: embed(sentences[:32]))
    return metrics, np.asarray(embed(sentences[:NUM_COMPARED]))


def measure_llama_server(
    source: ModelSource,
    pooling_type: str,
    sentences: list[str],
    threads: int,
    batch_size: int,
    repetitions: int,
) -> tuple[Metrics, np.ndarray]:
    """llama-server ``--embeddings`` on a GGUF of the same weights, sent ``batch_size`` inputs a
    request; raises when there is no tool build or the model is not a BERT folder."""
    if source.kind != "hf":
        raise ValueError("the GGUF is written from a Hugging Face BERT folder")
    model_file = bert_gguf(source.path, pooling_type)
    build = tool_build()
    port = free_port()
    # One slot per input of a request, each with room for the longest input.
    context = batch_size * 512
    command = [
        str(build.tool("llama-server")),
        *("-m", str(model_file), "--embeddings", "--pooling", pooling_type),
        *("-t", str(threads), "-tb", str(threads), "-np", str(batch_size)),
        *("-c", str(context), "-b", str(context), "-ub", str(context)),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    print(f"llama-server: {build.describe()}, {model_file.name} (float32), {threads} threads")
    with (
        server_process(command, "kvserve-bench-embed-") as (process, log_path),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client,
    ):
        asyncio.run(_ready(f"http://127.0.0.1:{port}", process, log_path))
        embed = functools.partial(_embed_all, client, batch_size)
        return _timed_embeddings(embed, sentences, repetitions)


def _embed_all(client: httpx.Client, batch_size: int, sentences: list[str]) -> list[list[float]]:
    vectors: list[list[float]] = []
    for start in range(0, len(sentences), batch_size):
        reply = client.post("/v1/embeddings", json={"input": sentences[start : start + batch_size]})
        reply.raise_for_status()
        vectors += [item["embedding"] for item in reply.json()["data"]]
    return vectors


async def _ready(base_url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    async with httpx.AsyncClient() as client:
        await wait_ready(client, base_url, process, 120, log_path)
