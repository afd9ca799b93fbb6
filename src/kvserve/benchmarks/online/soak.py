"""``kvserve bench soak``: hours-of-traffic behaviour of a running server, in minutes.

For ``--duration`` seconds (20 minutes by default), ``--concurrency``
clients send a mix of requests to the kvserve server at ``--base-url``:
normal streamed and non-streamed ones, clients that leave mid-stream or
before a long answer, bodies over the size limit, malformed JSON, and
requests with n > 1 and long ``max_tokens`` that force preemption when the
server has a small KV pool; with ``--hostile``, bodies that never arrive in
full and grammars that fail when used (``soak_hostile.py``); with
``--template-model``, chat requests to a second server whose chat template
does unbounded work (``soak_template.py``). Then it waits for the server to drain and
reports the requests by kind and outcome, the 5xx answers to valid requests
(there must be none), the output tokens per second, the KV blocks still in
use (from /metrics: there must be none), the preemptions, the slowest answer
of ``/health`` (asked throughout: within a second), and, with
``--server-pid``, the server's resident
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
import shlex
import sys
import time
from typing import Any

import httpx

from kvserve.benchmarks.common import write_json
from kvserve.benchmarks.online.serve_args import json_args
from kvserve.benchmarks.online.serve_client import (
    ServerError,
    auth_headers,
    list_models,
    make_client,
)
from kvserve.benchmarks.online.server_probe import (
    BLOCKS_USED,
    RUNNING,
    WAITING,
    metric_value,
    read_rss_bytes,
)
from kvserve.benchmarks.online.soak_args import add_arguments, check_args, selected_kinds
from kvserve.benchmarks.online.soak_hostile import HOSTILE_KINDS, send_hostile
from kvserve.benchmarks.online.soak_report import (
    MIB,
    HealthProbes,
    RssSample,
    SoakReport,
    summarize_rss,
)
from kvserve.benchmarks.online.soak_requests import Kind, Outcome, SoakTarget, send
from kvserve.benchmarks.online.soak_template import REFUSED_AT_LOAD, TEMPLATE, TemplateServer

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


async def soak(args: argparse.Namespace) -> SoakReport:
    """The load, the drain, and what both showed."""
    report = SoakReport(args.duration, max_rss_growth_bytes=int(args.max_rss_growth_mib * MIB))
    report.health = HealthProbes(args.max_health_seconds)
    kinds = selected_kinds(args)
    report.kinds = tuple(kind.name for kind in kinds)
    template_server = None
    if any(kind.name == TEMPLATE for kind in kinds):
        template_server = TemplateServer(
            args.template_model,
            args.template_server_memory_mib,
            args.template_start_timeout,
            args.template_timeout,
            args.max_health_seconds,
            tuple(shlex.split(args.template_server_args)),
        )
        report.template_server = template_server.report
    try:
        return await _soak(args, report, kinds, template_server)
    finally:
        if template_server is not None:
            template_server.stop()


async def _soak(
    args: argparse.Namespace,
    report: SoakReport,
    kinds: list[Kind],
    template_server: TemplateServer | None,
) -> SoakReport:
    base_url = args.base_url.rstrip("/")
    # Room for the clients, the probes beside them, and the template server's requests.
    async with make_client(args.concurrency + 4, args.timeout) as client:
        model = args.model or await _first_model(client, base_url, args.api_key)
        if template_server is not None:
            await template_server.start(client)
            if template_server.report.state == REFUSED_AT_LOAD:
                report.record(TEMPLATE, REFUSED_AT_LOAD, template_server.report.detail)
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

        weights = [kind.weight for kind in kinds]

        async def send_one(kind: Kind, rng: random.Random) -> Outcome | None:
            if kind.name == TEMPLATE:
                if template_server is None or not template_server.serving:
                    await asyncio.sleep(0.1)  # refused at load, or dead: nothing to send
                    return None
                return await template_server.send(client, rng)
            if kind in HOSTILE_KINDS:
                return await send_hostile(kind, client, target, rng, args.slow_body_seconds)
            return await send(kind, client, target, rng)

        async def client_loop(index: int) -> None:
            rng = random.Random(f"kvserve-bench-soak/{args.seed}/{index}")
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                outcome = await send_one(kind, rng)
                if outcome is not None:
                    report.record(kind.name, outcome.outcome, outcome.detail, outcome.output_tokens)

        health_url = _server_root(base_url) + "/health"

        async def sample_memory() -> None:
            next_progress = _PROGRESS_EVERY_S
            while True:
                elapsed = time.monotonic() - start
                if args.server_pid is not None:
                    rss = read_rss_bytes(args.server_pid)
                    if rss is not None:
                        samples.append(RssSample(elapsed, rss))
                await _probe_health(client, health_url, report.health)
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


async def _probe_health(client: httpx.AsyncClient, url: str, probes: HealthProbes) -> None:
    """Ask /health once (it needs no key); record how long the answer took, or its failure."""
    start = time.monotonic()
    try:
        response = await client.get(url, timeout=max(5.0, 2 * probes.limit_s))
        healthy = response.status_code == 200
    except httpx.HTTPError:
        healthy = False
    probes.record(time.monotonic() - start, healthy)


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
