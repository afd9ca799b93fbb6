"""``kvserve serve --ray``: the server as Ray Serve replicas on a local Ray cluster.

The flags are added to ``kvserve serve`` (``cli_serve.py``); ray is imported
only when ``--ray`` is given, so it stays an optional extra.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from kvserve.errors import InvalidParameterError

logger = logging.getLogger(__name__)

ROUTING_CHOICES = ("prefix", "kv-aware", "round-robin", "power-of-two")


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--ray`` flags of ``kvserve serve``."""
    group = parser.add_argument_group("ray serve (needs the [ray] extra)")
    group.add_argument(
        "--ray",
        action="store_true",
        help="serve with Ray Serve: engine replicas on a local Ray cluster behind one "
        "OpenAI ingress (the dashboard is off)",
    )
    group.add_argument("--replicas", type=int, default=2, help="engine replicas (with --ray)")
    group.add_argument(
        "--threads-per-replica",
        type=int,
        default=1,
        help="CPUs reserved for each replica and torch threads of its engine (with --ray)",
    )
    group.add_argument(
        "--routing",
        choices=ROUTING_CHOICES,
        default="prefix",
        help="how requests pick a replica: by shared prompt prefix, by the replicas' KV "
        "cache events (kv-aware: needs --kv-events-endpoint), in turn, or Ray's power of "
        "two choices (with --ray)",
    )
    group.add_argument(
        "--num-prefix-blocks",
        type=int,
        default=8,
        help="leading prompt blocks that key prefix- and kv-aware routing (with --ray)",
    )
    group.add_argument(
        "--saturation-queue-len",
        type=int,
        help="calls in flight past which prefix- and kv-aware routing pass a replica over for the "
        "least loaded one (default: --max-num-seqs) (with --ray)",
    )


def run_ray_serve(args: argparse.Namespace) -> int:
    """Start a local Ray cluster and the app; serve until Ctrl-C, then shut both down."""
    from kvserve.entrypoints.args import (
        engine_config_from_args,
        read_chat_template,
        server_config_from_args,
    )

    if args.trace is not None:
        sys.exit(
            "kvserve serve: --trace records one engine's steps; it is not available with --ray"
        )
    try:
        import ray
        from ray import serve

        from kvserve.serve.ray.app import RayServeOptions, check_routing
        from kvserve.serve.ray.local_cluster import deploy, start_ray, undeploy
    except ImportError as exc:
        sys.exit(f"kvserve serve --ray needs Ray Serve: pip install 'kvserve[ray]' ({exc})")
    try:
        server_config = server_config_from_args(args)
        engine_config = engine_config_from_args(args)
        template = read_chat_template(args.chat_template) if args.chat_template else None
        options = RayServeOptions(
            replicas=args.replicas,
            threads_per_replica=args.threads_per_replica,
            routing=args.routing,
            num_prefix_blocks=args.num_prefix_blocks,
            saturation_queue_len=args.saturation_queue_len,
        )
        check_routing(engine_config, options)
    except InvalidParameterError as exc:
        sys.exit(f"kvserve serve: {exc}")
    started = time.monotonic()
    start_ray(options)
    # After ray.init, whose handler would end the process without shutting anything down.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        deploy(engine_config, server_config, options, args.host, args.port, template)
        logger.info(
            "serving %s on http://%s:%d with %d replicas, %s routing (ready in %.1f s)",
            server_config.served_model_name,
            args.host,
            args.port,
            options.replicas,
            options.routing,
            time.monotonic() - started,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        undeploy(options)
        serve.shutdown()
        ray.shutdown()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
