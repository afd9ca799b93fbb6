"""``kvserve bench soak``: hours-of-traffic behaviour of a running server, in minutes.

For ``--duration`` seconds (20 minutes by default), ``--concurrency``
clients send a mix of requests to the kvserve server at ``--base-url``:
normal streamed and non-streamed ones, clients that leave mid-stream or
before a long answer, bodies over the size limit, malformed JSON, and
requests with n > 1 and long ``max_tokens`` that force preemption when the
server has a small KV pool. Then it waits for the server to drain and
reports the requests by kind and outcome, the 5xx answers to valid requests
(there must be none), the KV blocks still in use (from /metrics: there must
be none), the preemptions, and, with ``--server-pid``, the server's resident
memory sampled throughout: after warm-up against the end, and the largest
drift. Start the server with a small pool so that preemption happens and
the warm-up touches every block, for example::

    kvserve serve --model smollm2-135m-instruct --num-blocks 256
    kvserve bench soak --base-url http://127.0.0.1:8000/v1 --server-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

import httpx

from kvserve.benchmarks.common import write_json
from kvserve.benchmarks.serve_args import add_server_args, check_base_url, json_args
from kvserve.benchmarks.serve_client import ServerError, auth_headers, list_models, make_client
from kvserve.benchmarks.server_probe import (
    BLOCKS_USED,
    RUNNING,
    WAITING,
    metric_value,
    read_rss_bytes,
)
from kvserve.benchmarks.soak_report import MIB, RssSample, SoakReport, summarize_rss
from kvserve.benchmarks.soak_requests import KINDS, SoakTarget, send
from kvserve.errors import InvalidParameterError

PREEMPTIONS = "kvserve_num_preemptions_total"
_PROGRESS_EVERY_S = 60.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "soak",
        help="long mixed and hostile load on a kvserve server: no 5xx, no leaked KV block or memory",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add_server_args(parser)
    add("--server-pid", type=int, help="the server's process id, to sample its resident memory")
    add("--duration", type=float, default=1200.0, help="seconds of load (default %(default)g)")
    add(
        "--warmup",
        type=float,
        default=120.0,
        help="seconds before the memory baseline is taken (default %(default)g)",
    )
    add("--concurrency", type=int, default=8, help="clients at once (default %(default)s)")
    add(
        "--max-tokens", type=int, default=32, help="tokens per normal request (default %(default)s)"
    )
    add(
        "--long-max-tokens",
        type=int,
        default=256,
        help="tokens per preempting or abandoned request (default %(default)s)",
    )
    add("--preempt-n", type=int, default=4, help="n of preempting requests (default %(default)s)")
    add("--prompt-words", type=int, default=24, help="words per prompt (default %(default)s)")
    add(
        "--oversized-bytes",
        type=int,
        default=2 * MIB,
        help="size of the oversized bodies; must exceed the server's --max-request-body-bytes "
        "(default %(default)s)",
    )
    add(
        "--max-rss-growth-mib",
        type=float,
        default=256.0,
        help="the run fails if resident memory grows more than this after warm-up "
        "(default %(default)g)",
    )
    add("--rss-interval", type=float, default=2.0, help="seconds between memory samples")
    add("--drain-timeout", type=float, default=60.0, help="seconds to wait for the server to drain")
    add("--timeout", type=float, default=300.0, help="seconds one request may take")
    add("--seed", type=int, default=0, help="seeds the mix and the prompts (default %(default)s)")
    add("--json", metavar="PATH", help="also write the results as JSON")


def check_args(args: argparse.Namespace) -> None:
    """Refuse values no run could use, before anything is sent."""
    check_base_url(args.base_url)
    for name in ("concurrency", "max_tokens", "long_max_tokens", "preempt_n", "prompt_words"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"must be >= 1, got {getattr(args, name)}")
    for name in ("duration", "rss_interval", "timeout", "oversized_bytes"):
        if not getattr(args, name) > 0:
            raise InvalidParameterError(name, f"must be > 0, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.duration:
        raise InvalidParameterError(
            "warmup", f"must be in [0, duration={args.duration:g}), got {args.warmup:g}"
        )
    if args.server_pid is not None and read_rss_bytes(args.server_pid) is None:
        raise InvalidParameterError(
            "server_pid", f"no process {args.server_pid} whose memory can be read (Linux /proc)"
        )


async def soak(args: argparse.Namespace) -> SoakReport:
    """The load, the drain, and what both showed."""
    report = SoakReport(args.duration, max_rss_growth_bytes=int(args.max_rss_growth_mib * MIB))
    base_url = args.base_url.rstrip("/")
    # Room for the clients and the metric and memory probes beside them.
    async with make_client(args.concurrency + 2, args.timeout) as client:
        model = args.model or await _first_model(client, base_url, args.api_key)
        target = SoakTarget(
            base_url,
            model,
            args.api_key,
            args.max_tokens,
            args.long_max_tokens,
            args.preempt_n,
            args.prompt_words,
            args.oversized_bytes,
        )
        metrics_url = _server_root(base_url) + "/metrics"
        preemptions_before = await _metric(client, metrics_url, args.api_key, PREEMPTIONS)
        start = time.monotonic()
        deadline = start + args.duration
        samples: list[RssSample] = []

        async def client_loop(index: int) -> None:
            rng = random.Random(f"kvserve-bench-soak/{args.seed}/{index}")
            weights = [kind.weight for kind in KINDS]
            while time.monotonic() < deadline:
                kind = rng.choices(KINDS, weights)[0]
                outcome = await send(kind, client, target, rng)
                report.record(kind.name, outcome.outcome, outcome.detail)

        async def sample_memory() -> None:
            next_progress = _PROGRESS_EVERY_S
            while True:
                elapsed = time.monotonic() - start
                if args.server_pid is not None:
                    rss = read_rss_bytes(args.server_pid)
                    if rss is not None:
                        samples.append(RssSample(elapsed, rss))
                if elapsed >= next_progress:
                    next_progress += _PROGRESS_EVERY_S
                    _print_progress(report, elapsed, samples)
                await asyncio.sleep(args.rss_interval)

        sampler = asyncio.ensure_future(sample_memory())
        await asyncio.gather(*(client_loop(i) for i in range(args.concurrency)))
        report.wall_s = time.monotonic() - start
        held = await _drain(client, metrics_url, args.api_key, args.drain_timeout)
        sampler.cancel()
        if args.server_pid is not None and (rss := read_rss_bytes(args.server_pid)) is not None:
            samples.append(RssSample(time.monotonic() - start, rss))
        report.blocks_used_end, report.sequences_held_end = held
        preemptions_after = await _metric(client, metrics_url, args.api_key, PREEMPTIONS)
        if preemptions_before is not None and preemptions_after is not None:
            report.preemptions = preemptions_after - preemptions_before
    report.rss = summarize_rss(samples, args.warmup)
    return report


async def _first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    models = await list_models(client, base_url, api_key)
    if not models:
        raise ServerError(f"GET {base_url}/models lists no model; pass --model")
    return models[0]


def _server_root(base_url: str) -> str:
    """``http://host:port`` of ``http://host:port/v1``: /metrics is not under the API's root."""
    return base_url.removesuffix("/v1")


async def _metric(
    client: httpx.AsyncClient, url: str, api_key: str | None, name: str
) -> float | None:
    try:
        response = await client.get(url, headers=auth_headers(api_key))
    except httpx.HTTPError:
        return None
    return metric_value(response.text, name) if response.status_code == 200 else None


async def _drain(
    client: httpx.AsyncClient, url: str, api_key: str | None, timeout_s: float
) -> tuple[float | None, float | None]:
    """Wait until the server holds no KV block and no sequence; (blocks used, sequences held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = await _metric(client, url, api_key, BLOCKS_USED)
        running = await _metric(client, url, api_key, RUNNING)
        waiting = await _metric(client, url, api_key, WAITING)
        held = None if running is None or waiting is None else running + waiting
        if (blocks == 0 and held == 0) or time.monotonic() > deadline:
            return blocks, held
        await asyncio.sleep(0.5)


def _print_progress(report: SoakReport, elapsed: float, samples: list[RssSample]) -> None:
    rss = f", server RSS {samples[-1].rss_bytes / MIB:.0f} MiB" if samples else ""
    print(
        f"[{elapsed:.0f} s] {report.num_requests:,} requests, {report.valid_5xx} 5xx on valid "
        f"ones, {report.num_unexpected} unexpected answers{rss}",
        file=sys.stderr,
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    """Run the soak; exit code 0 when it passed, else 1."""
    check_args(args)
    try:
        report = asyncio.run(soak(args))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.format())
    if args.json:
        write_json(args.json, "soak", {"args": json_args(args), **report.as_json()})
    return 0 if report.passed else 1
