"""What the Ray Serve tests share besides the app fixture (``conftest.py``)."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

API_KEY = "ray-test-key"
MODEL_NAME = "tiny"
# max_model_len leaves room for long generations: the abort and failure tests need
# requests still running when they act.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "num_blocks": 512,
    "max_model_len": 512,
}
_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


@dataclass
class RayApp:
    """The deployed app: its URL, its metrics per replica, and the KV events endpoints
    its replicas publish on (the base port plus each replica's rank on the node)."""

    url: str
    headers: dict[str, str]
    kv_events_endpoints: tuple[str, ...] = ()

    def samples(self, name: str, **labels: str) -> dict[str, float]:
        """``name``'s value per replica (key ``replica``) and summed (key ``""``)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is None or match[1] != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
            if all(found.get(key) == value for key, value in labels.items()):
                values[found.get("replica", "")] = float(match[3])
        return values

    def engine_replica_names(self) -> list[str]:
        """The Ray actor names of the engine replicas."""
        import ray

        actors = ray.util.list_named_actors(all_namespaces=True)
        return sorted(a["name"] for a in actors if "#KVServeEngine#" in a["name"])


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail the test naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_run(length: int) -> int:
    """The first of ``length`` consecutive ports free on loopback now."""
    for _ in range(100):
        first = free_port()
        try:
            probes = []
            for port in range(first, first + length):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {length} consecutive free ports")
