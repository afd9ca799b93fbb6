"""``kvserve bench routing``: Ray Serve request routers side by side on one load.

Starts a local Ray cluster, then for each ``--routing`` in turn deploys the
model as ``--replicas`` engine replicas (``--threads-per-replica`` threads each)
behind the OpenAI ingress (``kvserve/serve/ray/``), runs ``kvserve bench serve``'s
load against it (warm-up, then ``--repetitions`` timed runs, medians) and
removes it. By default the load is the one prefix-aware routing is for:
shared-prefix prompts, every round with a prefix of its own. Prints output
tok/s and TTFT p50/p99 per router in one table; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import socket
import sys
from typing import TYPE_CHECKING, Any

from kvserve.benchmarks.common import Table, write_json
from kvserve.benchmarks.online.serve import benchmark
from kvserve.benchmarks.online.serve_args import add_load_arguments, check_args
from kvserve.benchmarks.online.serve_client import ServerError
from kvserve.benchmarks.online.serve_report import ServeReport, json_payload, prompt_description
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.entrypoints.openai import server_config as server_defaults
from kvserve.errors import InvalidParameterError

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

# kvserve.serve.ray.cli's, not imported: ray stays optional until a run starts.
ROUTING_CHOICES = ("prefix", "kv-aware", "round-robin", "power-of-two")
# The kv-aware run's replicas publish their KV cache events here unless
# --kv-events-endpoint says where: loopback (the cluster is local), a free port each.
KV_AWARE_EVENTS_ENDPOINT = "tcp://127.0.0.1:*"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "routing",
        help="Ray Serve replicas: prefix-aware routing vs round robin on a shared-prefix load",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ray_group = parser.add_argument_group("replicas")
    ray_group.add_argument("--replicas", type=int, default=2, help="engine replicas")
    ray_group.add_argument(
        "--threads-per-replica", type=int, default=1, help="torch threads of each replica"
    )
    ray_group.add_argument(
        "--routing",
        nargs="+",
        choices=ROUTING_CHOICES,
        default=["prefix", "round-robin"],
        help="the routers to compare, in this order",
    )
    ray_group.add_argument(
        "--saturation-queue-len",
        type=int,
        help="calls in flight past which prefix- and kv-aware routing pass a replica over "
        "(default: --max-num-seqs)",
    )
    ray_group.add_argument(
        "--port", type=int, default=0, help="the HTTP port (default: a free one)"
    )
    add_load_arguments(parser)
    # --seed is the prompts' (bench serve's); the engines keep their default seed.
    add_engine_args(parser, exclude=("seed",))
    parser.set_defaults(
        prompt_kind="shared-prefix",
        max_prefill_tokens_while_decoding=server_defaults.DEFAULT_SERVE_PREFILL_TOKENS_WHILE_DECODING,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _load_args(args: argparse.Namespace, base_url: str, model: str) -> argparse.Namespace:
    """``bench serve``'s arguments for one router's run."""
    return argparse.Namespace(
        **{**vars(args), "base_url": base_url, "model": model, "api_key": None}
    )


def compare(args: argparse.Namespace) -> dict[str, ServeReport]:
    """Each router's report, one deployment after another on one local cluster."""
    import ray
    from ray import serve

    from kvserve.config import EngineConfig
    from kvserve.entrypoints.openai.server_config import ServerConfig
    from kvserve.serve.ray.app import RayServeOptions
    from kvserve.serve.ray.local_cluster import deploy, start_ray, undeploy

    model, engine_args = engine_kwargs(args)
    engine_config = EngineConfig.from_kwargs(model, **engine_args)
    server_config = ServerConfig(model, enable_dashboard=False)
    port = args.port or _free_port()
    reports: dict[str, ServeReport] = {}
    options_list = [
        RayServeOptions(
            replicas=args.replicas,
            threads_per_replica=args.threads_per_replica,
            routing=routing,
            saturation_queue_len=args.saturation_queue_len,
        )
        for routing in args.routing
    ]
    start_ray(options_list[0])
    try:
        for options in options_list:
            print(f"deploying {options.replicas} replicas, {options.routing} routing ...")
            deploy(
                _engine_config_for(engine_config, options.routing),
                server_config,
                options,
                "127.0.0.1",
                port,
            )
            try:
                load = _load_args(args, f"http://127.0.0.1:{port}/v1", model)
                reports[options.routing] = asyncio.run(benchmark(load))
            finally:
                undeploy(options)
    finally:
        serve.shutdown()
        ray.shutdown()
    return reports


def _engine_config_for(engine_config: EngineConfig, routing: str) -> EngineConfig:
    """``engine_config``, publishing KV cache events for the kv-aware router if it does not."""
    events = engine_config.kv_events_config
    if routing != "kv-aware" or events.kv_events_endpoint is not None:
        return engine_config
    events = dataclasses.replace(events, kv_events_endpoint=KV_AWARE_EVENTS_ENDPOINT)
    return dataclasses.replace(engine_config, kv_events_config=events)


def print_table(args: argparse.Namespace, reports: dict[str, ServeReport]) -> None:
    print(
        f"{args.replicas} replicas x {args.threads_per_replica} thread(s), {args.model}: "
        f"{args.num_requests} requests, {args.concurrency} at a time, {prompt_description(args)}, "
        f"{args.max_tokens} output tokens each; medians of {args.repetitions}"
    )
    table = Table(["routing", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "failed"])
    for routing, report in reports.items():
        median = report.median
        table.add(
            routing,
            median.output_tokens_per_s,
            median.ttft_p50_ms,
            median.ttft_p99_ms,
            median.itl_p50_ms,
            report.num_failed,
        )
    print(table.render())


def run(args: argparse.Namespace) -> int:
    """Run the comparison; exit code 0 when every request succeeded, else 1."""
    check_args(_load_args(args, "http://127.0.0.1", args.model))
    for name in ("replicas", "threads_per_replica"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"must be >= 1, got {getattr(args, name)}")
    try:
        reports = compare(args)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_table(args, reports)
    if args.json:
        payload = {
            routing: json_payload(_load_args(args, "local ray serve", args.model), report)
            for routing, report in reports.items()
        }
        write_json(args.json, "routing", payload)
    return 0 if all(report.num_failed == 0 for report in reports.values()) else 1
