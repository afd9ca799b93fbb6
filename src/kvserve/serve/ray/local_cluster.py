"""Running the app on a Ray cluster started in this process (``kvserve serve --ray``)."""

from __future__ import annotations

import contextlib
import logging
import os

import ray
from ray import serve

from kvserve.config import EngineConfig
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.serve.ray.app import RayServeOptions, build_application
from kvserve.serve.ray.metrics_board import BOARD_NAMESPACE

logger = logging.getLogger(__name__)


def start_ray(options: RayServeOptions) -> None:
    """A local, loopback-only Ray cluster with CPUs for every replica (unless one runs)."""
    if ray.is_initialized():
        return
    needed = options.replicas * options.threads_per_replica
    cores = os.cpu_count() or 1
    if needed > cores:
        logger.warning(
            "%d replicas x %d threads need %d CPUs; this machine has %d: they will share cores",
            options.replicas,
            options.threads_per_replica,
            needed,
            cores,
        )
    ray.init(num_cpus=max(needed, cores), include_dashboard=False, log_to_driver=False)


def deploy(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    options: RayServeOptions,
    host: str,
    port: int,
    chat_template: str | None = None,
) -> None:
    """Start Serve's HTTP proxy on ``host:port`` and the app; returns once it is ready."""
    serve.start(http_options={"host": host, "port": port})
    app = build_application(engine_config, server_config, options, chat_template)
    serve.run(app, name=options.app_name, route_prefix="/")


def undeploy(options: RayServeOptions) -> None:
    """Delete the app and its metrics board (Serve itself keeps running)."""
    serve.delete(options.app_name)
    with contextlib.suppress(ValueError):  # never created
        ray.kill(ray.get_actor(options.board_name, namespace=BOARD_NAMESPACE))
