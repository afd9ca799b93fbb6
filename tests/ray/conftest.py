"""One local Ray cluster and one kvserve app on it, shared by every test in tests/ray.

The app: 2 engine replicas of the tiny model (1 thread each, prefix-aware
routing) behind the OpenAI ingress, with an API key. Test modules skip
themselves when ray is not installed (the ``[ray]`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_app_fixtures import API_KEY, ENGINE_ARGS, MODEL_NAME, RayApp, free_port

from model_fixtures import TINY_CHAT_TEMPLATE


@pytest.fixture(scope="session")
def ray_app(tiny_model_dir: Path) -> Iterator[RayApp]:
    """The local cluster and the app, started once for the directory."""
    import ray
    from ray import serve

    from kvserve.config import EngineConfig
    from kvserve.entrypoints.openai.server_config import ServerConfig
    from kvserve.serve.ray.app import RayServeOptions
    from kvserve.serve.ray.local_cluster import deploy, undeploy

    # Logical CPUs: 2 replicas of 1 CPU each, and room for Serve's own actors.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    options = RayServeOptions(replicas=2, threads_per_replica=1, routing="prefix")
    try:
        deploy(
            EngineConfig.from_kwargs(str(tiny_model_dir), **ENGINE_ARGS),
            ServerConfig(MODEL_NAME, api_keys=(API_KEY,)),
            options,
            "127.0.0.1",
            port,
            TINY_CHAT_TEMPLATE,
        )
        yield RayApp(f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {API_KEY}"})
    finally:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(60, exit=True, file=sys.__stderr__)
        undeploy(options)
        serve.shutdown()
        ray.shutdown()
