"""A second server with a hostile chat template, for ``kvserve bench soak --template-model``.

The soak starts ``kvserve serve`` on the given model (a tiny one will do)
with a chat template that does unbounded work: three nested loops over
``range(100000)`` when the conversation says ``ranges``, else a string of a
billion characters (``'x' * 1000000000``). Then the ``template`` kind sends
it chat requests, one at a time, and after each one asks its ``/health``
with a one-second limit.

A hardened server refuses the template when it loads it (a pass: the report
says so, and no request is sent), or answers each request with a 4xx and
stays healthy. Anything else is reported as found: a 5xx, a request that
times out (the render still running), ``/health`` slow or gone, the
process dead. The server runs at a lower CPU priority and with its data
memory capped (``--template-server-memory-mib``), so a template that runs
away costs the soak's main server little and the machine nothing worse than
that process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvserve.benchmarks.online.serve_client import list_models
from kvserve.benchmarks.online.soak_requests import ANY_4XX, Kind, Outcome, status_outcome

TEMPLATE = "template"
REFUSED_AT_LOAD = "refused at load"

TEMPLATE_KIND = Kind(
    TEMPLATE,
    3,
    False,
    frozenset({ANY_4XX, REFUSED_AT_LOAD}),
    "a chat request to the second server, whose chat template does unbounded work",
)

HOSTILE_TEMPLATE = (
    "{%- if messages[0]['content'] == 'ranges' -%}"
    "{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- for k in range(100000) -%}"
    "x{%- endfor -%}{%- endfor -%}{%- endfor -%}"
    "{%- else -%}{{ 'x' * 1000000000 }}{%- endif -%}"
)
_CONTENTS = ("ranges", "repeat")
_LOG_TAIL_CHARS = 600


@dataclass
class TemplateServerReport:
    """What became of the second server: whether it started, its health, whether it died."""

    model: str
    state: str = "not started"  # started | refused at load | did not start
    detail: str | None = None  # the end of its log, when it did not start
    health_ok: int = 0
    health_slow: int = 0  # answered, but after more than the limit
    health_failed: int = 0  # no answer, or not a 200
    died: bool = False
    health_latencies: list[float] = field(default_factory=list)

    def problems(self) -> list[str]:
        problems = []
        if self.state == "did not start":
            problems.append(f"the hostile-template server did not start: {self.detail}")
        if self.health_slow or self.health_failed:
            problems.append(
                f"the hostile-template server's /health was slow {self.health_slow} times "
                f"and failed {self.health_failed} times"
            )
        if self.died:
            problems.append("the hostile-template server died")
        return problems

    def line(self) -> str:
        if self.state != "started":
            extra = f" ({self.detail})" if self.detail else ""
            return f"hostile-template server on {self.model}: {self.state}{extra}"
        worst = max(self.health_latencies, default=0.0)
        return (
            f"hostile-template server on {self.model}: started; /health after its requests: "
            f"{self.health_ok} ok, {self.health_slow} slow, {self.health_failed} failed "
            f"(slowest {worst:.2f} s); died: {'yes' if self.died else 'no'}"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "state": self.state,
            "detail": self.detail,
            "health_ok": self.health_ok,
            "health_slow": self.health_slow,
            "health_failed": self.health_failed,
            "died": self.died,
        }


class TemplateServer:
    """``kvserve serve`` on ``model`` with :data:`HOSTILE_TEMPLATE`, started and stopped here."""

    def __init__(
        self,
        model: str,
        memory_mib: int,
        start_timeout_s: float,
        request_timeout_s: float,
        health_limit_s: float = 1.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.report = TemplateServerReport(model)
        self._model = model
        self._memory_bytes = memory_mib * 1024 * 1024
        self._start_timeout_s = start_timeout_s
        self._request_timeout_s = request_timeout_s
        self._health_limit_s = health_limit_s
        self._extra_args = extra_args
        self._process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvserve-soak-template-")
        self._log_path = Path(self._dir.name) / "server.log"
        self._url = ""
        self._served_model = ""
        self._lock = asyncio.Lock()  # one hostile render in flight at a time

    @property
    def serving(self) -> bool:
        return self.report.state == "started" and not self.report.died

    async def start(self, client: httpx.AsyncClient) -> None:
        """Start the server and wait for its /health, its exit, or the start timeout."""
        template_path = Path(self._dir.name) / "hostile.jinja"
        template_path.write_text(HOSTILE_TEMPLATE, encoding="utf-8")
        port = _free_port()
        self._url = f"http://127.0.0.1:{port}"
        # The child lowers its own priority and caps its data memory before it imports
        # anything (no preexec_fn: this process may run threads).
        limit = self._memory_bytes
        launcher = (
            "import os, resource, sys; os.nice(10); "
            f"resource.setrlimit(resource.RLIMIT_DATA, ({limit}, {limit})); "
            "from kvserve.cli import main; sys.exit(main(sys.argv[1:]))"
        )
        command = [sys.executable, "-c", launcher, "serve", "--model", self._model]
        command += ["--chat-template", str(template_path), "--host", "127.0.0.1"]
        command += ["--port", str(port), *self._extra_args]
        with self._log_path.open("wb") as log:
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self.report.state, self.report.detail = REFUSED_AT_LOAD, self._log_tail()
                return
            with contextlib.suppress(httpx.HTTPError):
                response = await client.get(self._url + "/health", timeout=1.0)
                if response.status_code == 200:
                    models = await list_models(client, self._url + "/v1", None)
                    self._served_model = models[0] if models else self._model
                    self.report.state = "started"
                    return
            await asyncio.sleep(0.25)
        self.report.state, self.report.detail = "did not start", self._log_tail()

    async def send(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        """One chat request, then a look at /health; the request's outcome."""
        async with self._lock:
            body = {
                "model": self._served_model,
                "messages": [{"role": "user", "content": rng.choice(_CONTENTS)}],
                "max_tokens": 4,
            }
            try:
                response = await client.post(
                    self._url + "/v1/chat/completions", json=body, timeout=self._request_timeout_s
                )
                outcome = status_outcome(response)
            except httpx.TimeoutException:
                outcome = Outcome("timeout")
            except httpx.HTTPError as exc:
                outcome = Outcome("transport error", f"{type(exc).__name__}: {exc}"[:200])
            await self._check_health(client)
            return outcome

    async def _check_health(self, client: httpx.AsyncClient) -> None:
        start = time.monotonic()
        try:
            response = await client.get(self._url + "/health", timeout=self._health_limit_s)
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        elapsed = time.monotonic() - start
        self.report.health_latencies.append(elapsed)
        if not healthy:
            self.report.health_failed += 1
        elif elapsed > self._health_limit_s:
            self.report.health_slow += 1
        else:
            self.report.health_ok += 1
        if self._process is not None and self._process.poll() is not None:
            self.report.died = True

    def stop(self) -> None:
        """End the server (its whole process group) and remove its files."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._dir.cleanup()

    def _log_tail(self) -> str:
        try:
            text = self._log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return text.strip()[-_LOG_TAIL_CHARS:]


def _free_port() -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
