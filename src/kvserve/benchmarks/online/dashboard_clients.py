"""``kvserve bench dashboard``: does watching the engine slow it down?

Runs the same streamed load against a kvserve server (``--base-url``) with no
dashboard client connected and with ``--clients`` clients on the state
stream (``GET /dashboard/events``), ``--silent-clients`` of which connect and
never read a byte, and reports the output tokens per second of each side by
side. The two settings alternate within each of ``--repetitions`` rounds
(0 then N, N then 0, ...) so that drift in the machine's speed falls on both,
and the medians are compared. The exit code is 1 when the slowdown passes
``--max-slowdown`` (or a request failed), 0 otherwise.

Each round draws fresh prompts, so the prefix cache carries nothing from one
round to the next. Run the benchmark from another machine, or ``nice`` it,
where cores are few: the reading clients cost the client machine some CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvserve.benchmarks.common import Table, write_json
from kvserve.benchmarks.online.serve_args import add_server_args, check_base_url, json_args
from kvserve.benchmarks.online.serve_client import (
    ServerError,
    Target,
    auth_headers,
    list_models,
    make_client,
    run_requests,
)
from kvserve.benchmarks.workloads.prompts import make_prompts
from kvserve.errors import InvalidParameterError

EVENTS_PATH = "/dashboard/events"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dashboard",
        help="engine throughput with and without many dashboard clients on the state stream",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add = parser.add_argument
    add_server_args(parser)
    add("--clients", type=int, default=50, help="dashboard clients (default %(default)s)")
    add(
        "--silent-clients",
        type=int,
        default=10,
        help="of those, how many never read (default %(default)s)",
    )
    add("--num-requests", type=int, default=64, help="requests per run (default %(default)s)")
    add("--concurrency", type=int, default=16, help="requests at once (default %(default)s)")
    add("--max-tokens", type=int, default=128, help="tokens per request (default %(default)s)")
    add("--prompt-tokens", type=int, default=64, help="about this many (default %(default)s)")
    add("--repetitions", type=int, default=3, help="rounds of both settings (default %(default)s)")
    add(
        "--max-slowdown",
        type=float,
        default=0.10,
        help="the largest acceptable drop in output tok/s (default %(default)s)",
    )
    add("--timeout", type=float, default=300.0, help="seconds one request may take")
    add("--seed", type=int, default=0, help="seeds the prompts (default %(default)s)")
    add("--json", metavar="PATH", help="also write the results as JSON")
    parser.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> None:
    """Refuse values no run could use, before anything is sent."""
    check_base_url(args.base_url)
    for name in ("clients", "num_requests", "concurrency", "max_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"must be >= 1, got {getattr(args, name)}")
    if args.repetitions < 1:
        raise InvalidParameterError("repetitions", f"must be >= 1, got {args.repetitions}")
    if not 0 <= args.silent_clients <= args.clients:
        raise InvalidParameterError(
            "silent_clients", f"must be in [0, clients={args.clients}], got {args.silent_clients}"
        )
    if not 0 <= args.max_slowdown < 1:
        raise InvalidParameterError("max_slowdown", f"must be in [0, 1), got {args.max_slowdown}")


def events_url(base_url: str) -> str:
    """The state stream's URL beside an API root (``.../v1`` or the server's root)."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") + EVENTS_PATH


class Watchers:
    """Dashboard clients: ``reading`` that consume every frame, ``silent`` that never read."""

    def __init__(self, url: str, num_reading: int, num_silent: int, api_key: str | None) -> None:
        self.url = url
        self.num_reading = num_reading
        self.num_silent = num_silent
        self.api_key = api_key
        self.num_frames = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Watchers:
        connected = [asyncio.Event() for _ in range(self.num_reading)]
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=30.0),
            limits=httpx.Limits(max_connections=self.num_reading + 1),
            trust_env=False,
        )
        self._tasks = [asyncio.create_task(self._read(event)) for event in connected]
        for _ in range(self.num_silent):
            self._writers.append(await self._open_silent())
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in connected)), 30)
        except asyncio.TimeoutError:
            await self.__aexit__()
            raise ServerError(f"dashboard clients got no frame from {self.url} in 30 s") from None
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        await self._client.aclose()

    async def _read(self, connected: asyncio.Event) -> None:
        headers = auth_headers(self.api_key)
        async with self._client.stream("GET", self.url, headers=headers) as response:
            if response.status_code != 200:
                raise ServerError(f"GET {self.url}: HTTP {response.status_code}")
            async for chunk in response.aiter_bytes():
                frames = chunk.count(b"data: ")
                self.num_frames += frames
                if frames:
                    connected.set()

    async def _open_silent(self) -> asyncio.StreamWriter:
        """Send the request, then never read: the server's buffers for it fill and stay full."""
        parts = urlsplit(self.url)
        secure = parts.scheme == "https"
        port = parts.port or (443 if secure else 80)
        context = ssl.create_default_context() if secure else None
        _, writer = await asyncio.open_connection(parts.hostname, port, ssl=context)
        headers = "".join(f"{k}: {v}\r\n" for k, v in auth_headers(self.api_key).items())
        request = f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{headers}\r\n"
        writer.write(request.encode())
        await writer.drain()
        return writer


@dataclass(frozen=True)
class Run:
    clients: int
    output_tok_s: float
    wall_s: float
    num_failed: int
    frames_per_client_s: float


async def benchmark(args: argparse.Namespace) -> list[Run]:
    """Every run of both settings, in the order they ran."""
    base_url = args.base_url.rstrip("/")
    runs: list[Run] = []
    async with make_client(args.concurrency, args.timeout) as client:
        model = args.model
        if model is None:
            models = await list_models(client, base_url, args.api_key)
            if not models:
                raise ServerError(f"GET {base_url}/models lists no model; pass --model")
            model = models[0]
        target = Target(base_url, model, "chat", args.max_tokens, args.api_key)

        async def load(round_name: str, count: int) -> tuple[float, float, int]:
            prompts = make_prompts("distinct", count, args.prompt_tokens, 0, args.seed, round_name)
            record = await run_requests(
                client, target, prompts, args.concurrency, args.timeout, args.timeout
            )
            tokens = sum(r.num_tokens for r in record.requests if r.error is None)
            failed = sum(r.error is not None for r in record.requests)
            return tokens / record.wall_s, record.wall_s, failed

        await load("warmup", min(args.num_requests, args.concurrency))
        for repetition in range(args.repetitions):
            order = (0, args.clients) if repetition % 2 == 0 else (args.clients, 0)
            for clients in order:
                name = f"run-{repetition}-{clients}"
                if clients == 0:
                    tok_s, wall_s, failed = await load(name, args.num_requests)
                    runs.append(Run(0, tok_s, wall_s, failed, 0.0))
                    continue
                num_reading = clients - args.silent_clients
                url = events_url(base_url)
                async with Watchers(url, num_reading, args.silent_clients, args.api_key) as w:
                    start_frames, start = w.num_frames, time.perf_counter()
                    tok_s, wall_s, failed = await load(name, args.num_requests)
                    elapsed = time.perf_counter() - start
                    rate = (w.num_frames - start_frames) / max(num_reading, 1) / elapsed
                runs.append(Run(clients, tok_s, wall_s, failed, rate))
    return runs


def summarize(runs: list[Run], clients: int) -> tuple[float, float]:
    """(median output tok/s without clients, with ``clients``)."""
    without = statistics.median(r.output_tok_s for r in runs if r.clients == 0)
    with_clients = statistics.median(r.output_tok_s for r in runs if r.clients == clients)
    return without, with_clients


def run(args: argparse.Namespace) -> int:
    check_args(args)
    try:
        runs = asyncio.run(benchmark(args))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    without, with_clients = summarize(runs, args.clients)
    slowdown = 1.0 - with_clients / without if without > 0 else 0.0
    table = Table(
        ["dashboard clients", "output tok/s (median)", "runs (tok/s)", "frames/s per reader"]
    )
    for clients, median in ((0, without), (args.clients, with_clients)):
        mine = [r for r in runs if r.clients == clients]
        table.add(
            f"{clients} ({args.silent_clients} silent)" if clients else "0",
            f"{median:.1f}",
            " ".join(f"{r.output_tok_s:.1f}" for r in mine),
            f"{statistics.median(r.frames_per_client_s for r in mine):.1f}" if clients else "-",
        )
    print(table.render())
    num_failed = sum(r.num_failed for r in runs)
    verdict = "ok" if slowdown <= args.max_slowdown else "TOO SLOW"
    print(
        f"slowdown with {args.clients} clients: {100 * slowdown:.1f}% "
        f"(limit {100 * args.max_slowdown:.0f}%): {verdict}; failed requests: {num_failed}"
    )
    if args.json:
        payload = {
            "args": json_args(args),
            "output_tok_s_without": without,
            "output_tok_s_with": with_clients,
            "slowdown": slowdown,
            "runs": [asdict(r) for r in runs],
        }
        write_json(args.json, "dashboard", payload)
    return 0 if slowdown <= args.max_slowdown and num_failed == 0 else 1
