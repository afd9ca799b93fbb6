"""``kvserve bench embed --mixed``: does an embedding stream slow the chat streams beside it?

One ``kvserve serve --model CHAT --embedding-model EMBEDDER`` process (the
two engines side by side), warmed up, then two phases of ``--duration``
seconds each: ``--chat-streams`` clients that each send chat completions
back to back (128 tokens, seeded prompts of 20 to 60 words), first alone,
then beside a stream of single-sentence embedding requests sent at
``--embed-rate`` per second (sent on schedule, whether or not earlier ones
have returned). The figure is chat output tokens per second in each phase;
the embedding phase also reports the sentences served, their latency and
how many the server refused (503: an embedder so far behind that the
backlog passed the server's connection limit).
The server runs with ``kvserve serve``'s default engine flags (the bench's
engine flags configure the offline measurement only).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from kvserve.benchmarks.common import Table, cpu_info, write_json
from kvserve.benchmarks.online.serve_client import make_client
from kvserve.benchmarks.online.serve_memory import (
    free_port,
    kvserve_command,
    server_process,
    wait_ready,
)
from kvserve.benchmarks.workloads.sentences import embedding_sentences
from kvserve.benchmarks.workloads.text import random_words
from kvserve.entrypoints.openai.server_config import DEFAULT_LIMIT_CONCURRENCY

MAX_TOKENS = 128


def run_mixed(args: argparse.Namespace) -> int:
    print(cpu_info().describe())
    port = free_port()
    # Every client here is one peer (127.0.0.1), standing in for many users: allow it the
    # server's whole connection limit, as behind a proxy. A backlog past that is refused
    # with 503 and counted (the embedder fell behind), not taken as the bench failing.
    extra = [
        "--embedding-model",
        args.model,
        "--no-dashboard",
        "--limit-concurrency-per-peer",
        str(DEFAULT_LIMIT_CONCURRENCY),
    ]
    command = kvserve_command(args.chat_model, port, extra)
    print(f"server: {' '.join(command[3:])}")
    with server_process(command, "kvserve-bench-mixed-") as (process, log_path):
        results = asyncio.run(_phases(args, f"http://127.0.0.1:{port}", process, log_path))
    table = Table(
        ["phase", "chat output tok/s", "chat requests", "sentences/s", "embed p50 s", "refused"]
    )
    for name, phase in results.items():
        table.add(
            name,
            phase["chat_tokens_per_s"],
            int(phase["chat_requests"]),
            phase.get("sentences_per_s", "-"),
            phase.get("embed_p50_s", "-"),
            int(phase["embeddings_refused"]) if "embeddings_refused" in phase else "-",
        )
    alone = results["chat alone"]["chat_tokens_per_s"]
    mixed = results["chat + embeddings"]["chat_tokens_per_s"]
    print(
        f"{args.chat_streams} chat streams ({args.chat_model}, {MAX_TOKENS} tokens each) beside "
        f"{args.embed_rate:g} sentences/s ({args.model}), {args.duration:g} s per phase"
    )
    print(table.render())
    print(f"chat output with embeddings: {100 * mixed / alone:.1f}% of chat alone")
    if args.json:
        write_json(
            args.json, "embed-mixed", {"args": vars(args) | {"run": None}, "results": results}
        )
    return 0


async def _phases(
    args: argparse.Namespace, base_url: str, process: subprocess.Popen[bytes], log_path: Path
) -> dict[str, dict[str, float]]:
    async with make_client(args.chat_streams + 64, 600) as client:
        await wait_ready(client, base_url, process, 600, log_path)
        sentences = embedding_sentences(1000, 10, 60, args.seed)
        await _run_phase(client, base_url, args, sentences, 5.0, embed=True)  # warm-up
        alone = await _run_phase(client, base_url, args, sentences, args.duration, embed=False)
        mixed = await _run_phase(client, base_url, args, sentences, args.duration, embed=True)
    return {"chat alone": alone, "chat + embeddings": mixed}


async def _run_phase(
    client: httpx.AsyncClient,
    base_url: str,
    args: argparse.Namespace,
    sentences: list[str],
    duration: float,
    embed: bool,
) -> dict[str, float]:
    deadline = time.perf_counter() + duration
    rng = random.Random(args.seed)
    chat_tokens: list[int] = []
    latencies: list[float] = []
    refused = 0

    async def chat_stream() -> None:
        while time.perf_counter() < deadline:
            prompt = random_words(rng, rng.randint(20, 60))
            reply = await client.post(
                base_url + "/v1/chat/completions",
                json={
                    "model": args.chat_model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                },
            )
            reply.raise_for_status()
            if time.perf_counter() <= deadline:  # only requests that ended inside the window
                chat_tokens.append(reply.json()["usage"]["completion_tokens"])

    async def one_embedding(sentence: str) -> None:
        nonlocal refused
        started = time.perf_counter()
        reply = await client.post(
            base_url + "/v1/embeddings", json={"model": args.model, "input": sentence}
        )
        if reply.status_code == 503:
            refused += 1
            return
        reply.raise_for_status()
        latencies.append(time.perf_counter() - started)

    async def embedding_stream() -> None:
        tasks = []
        started = time.perf_counter()
        for index in range(int(duration * args.embed_rate)):
            await asyncio.sleep(max(0.0, started + index / args.embed_rate - time.perf_counter()))
            sentence = sentences[index % len(sentences)]
            tasks.append(asyncio.ensure_future(one_embedding(sentence)))
        await asyncio.gather(*tasks)

    started = time.perf_counter()
    jobs = [chat_stream() for _ in range(args.chat_streams)]
    if embed:
        jobs.append(embedding_stream())
    await asyncio.gather(*jobs)
    result = {
        "chat_tokens_per_s": sum(chat_tokens) / duration,
        "chat_requests": float(len(chat_tokens)),
    }
    if embed:
        result["sentences_per_s"] = len(latencies) / (time.perf_counter() - started)
        result["embed_p50_s"] = statistics.median(latencies) if latencies else float("nan")
        result["embeddings_refused"] = float(refused)
    return result
