"""One local Ray cluster and one kvserve app on it, shared by every test in tests/ray.

The app: 2 engine replicas of the tiny model (1 thread each, prefix-aware
routing) behind the OpenAI ingress, with an API key. Test modules skip
themselves when ray is not installed (the ``[ray]`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_app_fixtures import API_KEY, ENGINE_ARGS, MODEL_NAME, RayApp, free_port, free_port_run

from model_fixtures import TINY_CHAT_TEMPLATE


@pytest.fixture(scope="session")
def ray_app(ray_session: None, tiny_model_dir: Path) -> Iterator[RayApp]:
    """The app on the run's local cluster (``ray_session``), deployed once."""
    from ray import serve

    from kvserve.config import EngineConfig
    from kvserve.entrypoints.openai.server_config import ServerConfig
    from kvserve.serve.ray.app import RayServeOptions
    from kvserve.serve.ray.local_cluster import deploy, undeploy

    port = free_port()
    events_port = free_port_run(2)
    options = RayServeOptions(replicas=2, threads_per_replica=1, routing="prefix")
    try:
        deploy(
            EngineConfig.from_kwargs(
                str(tiny_model_dir),
                **ENGINE_ARGS,
                kv_events_endpoint=f"tcp://127.0.0.1:{events_port}",
            ),
            ServerConfig(MODEL_NAME, api_keys=(API_KEY,)),
            options,
            "127.0.0.1",
            port,
            TINY_CHAT_TEMPLATE,
        )
        yield RayApp(
            f"http://127.0.0.1:{port}",
            {"Authorization": f"Bearer {API_KEY}"},
            tuple(f"tcp://127.0.0.1:{events_port + rank}" for rank in range(2)),
        )
    finally:
        undeploy(options)
        serve.shutdown()
