"""``kvserve bench serve-memory``: kvserve's server and llama-server on one GGUF, resident memory.

Each server is started here on the same file, with its own default settings
(kvserve: ``kvserve serve --model FILE``; llama.cpp: ``llama-server -m FILE``
from the benchmarks' build, :mod:`kvserve.benchmarks.baselines.llamacpp_build`),
one after the other so neither shares the machine with the other. When its
``/health`` answers 200, a small fixed load (``--num-requests`` streamed
completions, ``--concurrency`` at a time, ``--max-tokens`` each, prompts of
about ``--prompt-tokens`` tokens) runs, then the server is stopped.

Reported per server: the peak of its process tree's resident memory (VmRSS
summed over the server and its descendants, sampled ten times a second from
start to stop), its own ``VmHWM`` (the kernel's exact peak for the server
process), its resident memory after the load, the seconds until it was
ready and its output tok/s under the load; then kvserve's memory over
llama-server's (below 1.00x kvserve holds less). Both figures count the
mapped model file's pages that were touched, as ``top`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from kvserve.benchmarks.baselines.llamacpp_baseline import add_llamacpp_args
from kvserve.benchmarks.baselines.llamacpp_tools import ToolRun, prepare_tool_run
from kvserve.benchmarks.common import Table, ratio, write_json
from kvserve.benchmarks.online.process_memory import TreePeakSampler, process_memory
from kvserve.benchmarks.online.serve_client import ServerError, Target, list_models, make_client
from kvserve.benchmarks.online.serve_client import run_requests as send_load
from kvserve.benchmarks.online.serve_metrics import summarize
from kvserve.benchmarks.workloads.prompts import make_prompts
from kvserve.errors import InvalidParameterError

KVSERVE = "kvserve"
LLAMA_SERVER = "llama-server"
SERVERS = (KVSERVE, LLAMA_SERVER)
_GIB = 1024**3
_LOG_TAIL_CHARS = 1500


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve-memory", help=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--model", required=True, help="a GGUF file or an alias of one")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds to be ready")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--kvserve-args", default="", help="more flags for kvserve serve")
    parser.add_argument("--llama-server-args", default="", help="more flags for llama-server")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_llamacpp_args(parser)
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class ServerMemory:
    """One server's figures; memory in bytes."""

    server: str
    command: list[str]
    ready_s: float
    tree_peak_rss_bytes: int
    hwm_bytes: int
    rss_after_load_bytes: int
    output_tokens_per_s: float
    num_failed: int


@dataclass(frozen=True)
class Load:
    """The fixed load every server gets."""

    num_requests: int
    concurrency: int
    max_tokens: int
    prompt_tokens: int
    seed: int
    start_timeout_s: float
    request_timeout_s: float


def kvserve_command(model: str, port: int, extra: list[str]) -> list[str]:
    launcher = "import sys; from kvserve.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", launcher, "serve", "--model", model]
    return [*command, "--host", "127.0.0.1", "--port", str(port), *extra]


def llama_server_command(tools: ToolRun, port: int, extra: list[str]) -> list[str]:
    server = str(tools.build.tool(LLAMA_SERVER))
    return [server, "-m", str(tools.model_file), "--host", "127.0.0.1", "--port", str(port), *extra]


def free_port() -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def measure_server(name: str, command: list[str], port: int, load: Load) -> ServerMemory:
    """Start ``command`` (listening on ``port``), wait until ready, load it, stop it."""
    base_url = f"http://127.0.0.1:{port}"
    with server_process(command, "kvserve-serve-memory-") as (process, log_path):
        with TreePeakSampler(process.pid) as sampler:
            started = time.perf_counter()
            async with make_client(load.concurrency, load.request_timeout_s) as client:
                await wait_ready(client, base_url, process, load.start_timeout_s, log_path)
                ready_s = time.perf_counter() - started
                models = await list_models(client, base_url + "/v1", None)
                model = models[0] if models else name
                target = Target(base_url + "/v1", model, "completions", load.max_tokens)
                prompts = make_prompts(
                    "distinct", load.num_requests, load.prompt_tokens, 0, load.seed, "memory"
                )
                record = await send_load(
                    client,
                    target,
                    prompts,
                    load.concurrency,
                    load.request_timeout_s,
                    load.request_timeout_s * load.num_requests,
                )
            sampler.sample_now()
            after = process_memory(process.pid)
        if after is None:  # read its log while the folder still holds it
            raise ServerError(f"{name} exited during the load; its log:\n{_tail(log_path)}")
    metrics = summarize(record)
    return ServerMemory(
        name,
        command,
        ready_s,
        sampler.peak_bytes,
        after.hwm_bytes,
        after.rss_bytes,
        metrics.output_tokens_per_s,
        metrics.num_failed,
    )


async def wait_ready(
    client: httpx.AsyncClient,
    base_url: str,
    process: subprocess.Popen[bytes],
    timeout_s: float,
    log_path: Path,
) -> None:
    """Return once ``/health`` answers 200; raise if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(
                f"exited with {process.returncode} before it was ready; its log:\n{_tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            response = await client.get(base_url + "/health", timeout=2.0)
            if response.status_code == 200:
                return
        await asyncio.sleep(0.25)
    raise ServerError(f"not ready after {timeout_s:g} s; its log:\n{_tail(log_path)}")


@contextlib.contextmanager
def server_process(
    command: list[str], prefix: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``command`` started in a process group of its own, its output in a log file in a
    temporary folder named ``prefix...``; the group is stopped when the block ends."""
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        log_path = Path(folder) / "server.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            yield process, log_path
        finally:
            _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End the server's whole process group: SIGTERM, then SIGKILL after 20 s."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _tail(log_path: Path) -> str:
    try:
        return log_path.read_text(encoding="utf-8", errors="replace").strip()[-_LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"


def check_args(args: argparse.Namespace) -> None:
    """Refuse values no run could use, before any server starts."""
    for name in ("num_requests", "concurrency", "max_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"must be >= 1, got {getattr(args, name)}")
    for name in ("start_timeout", "timeout"):
        if not getattr(args, name) > 0:
            raise InvalidParameterError(name, f"must be > 0 seconds, got {getattr(args, name)}")


def memory_table(results: list[ServerMemory]) -> Table:
    """A row per server; kvserve's carries its memory over llama-server's."""
    by_name = {result.server: result for result in results}
    theirs = by_name.get(LLAMA_SERVER)
    columns = ["server", "ready s", "tree peak RSS GiB", "VmHWM GiB", "RSS after GiB", "tok/s"]
    compare = KVSERVE in by_name and theirs is not None
    table = Table(columns + (["peak vs llama-server", "HWM vs llama-server"] if compare else []))
    for result in results:
        cells: list[object] = [
            result.server,
            result.ready_s,
            result.tree_peak_rss_bytes / _GIB,
            result.hwm_bytes / _GIB,
            result.rss_after_load_bytes / _GIB,
            result.output_tokens_per_s,
        ]
        if compare and theirs is not None:
            mine = result.server == KVSERVE
            cells.append(
                ratio(result.tree_peak_rss_bytes, theirs.tree_peak_rss_bytes) if mine else ""
            )
            cells.append(ratio(result.hwm_bytes, theirs.hwm_bytes) if mine else "")
        table.add(*cells)
    return table


def run(args: argparse.Namespace) -> int:
    """Measure each server in turn; exit code 0 when every request of every server succeeded."""
    check_args(args)
    # The tools and the file are checked before any server starts.
    tools = None
    if LLAMA_SERVER in args.servers:
        tools = prepare_tool_run(args.model, args.llamacpp_weights)
        if not tools.build.tool(LLAMA_SERVER).exists():
            raise InvalidParameterError(
                "servers",
                f"{tools.build.tool(LLAMA_SERVER)} is missing; rebuild with make bench-deps",
            )
        print(tools.describe(LLAMA_SERVER))
    load = Load(
        args.num_requests,
        args.concurrency,
        args.max_tokens,
        args.prompt_tokens,
        args.seed,
        args.start_timeout,
        args.timeout,
    )
    results = []
    for name in args.servers:
        port = free_port()
        if name == KVSERVE:
            command = kvserve_command(args.model, port, shlex.split(args.kvserve_args))
        else:
            assert tools is not None
            command = llama_server_command(tools, port, shlex.split(args.llama_server_args))
        print(f"{name}: {shlex.join(command)}", flush=True)
        try:
            results.append(asyncio.run(measure_server(name, command, port, load)))
        except ServerError as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 1
    print(
        f"{load.num_requests} completions, {load.concurrency} at a time, ~{load.prompt_tokens}-"
        f"token prompts, {load.max_tokens} output tokens each; memory sampled every 0.1 s"
    )
    print(memory_table(results).render())
    if args.json:
        payload = {
            "args": {k: v for k, v in vars(args).items() if k != "run"},
            "tools": tools.as_json() if tools is not None else None,
            "results": [asdict(result) for result in results],
        }
        write_json(args.json, "serve-memory", payload)
    return 0 if all(result.num_failed == 0 for result in results) else 1
