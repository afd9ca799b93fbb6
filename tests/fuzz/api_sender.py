"""Sending the API fuzzer's cases and checking each answer; crashes, auth probes, the end state."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests

from fuzz.api_checks import Answer, Violation, check_answer
from fuzz.api_fuzz_summary import FuzzSummary
from kvserve.benchmarks.online.server_probe import BLOCKS_USED, RUNNING, WAITING, metric_value

REQUEST_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 30.0
PROGRESS_EVERY = 500  # cases between progress lines on stderr
AUTH_PROBE_EVERY = 4  # with a key, every fourth case is sent again without a valid one
# Authorization values a client without the key might send; None sends no header.
_WRONG_AUTHORIZATION: tuple[Callable[[str], str | None], ...] = (
    lambda key: None,
    lambda key: "Bearer wrong-key",
    lambda key: f"Bearer {key}x",
    lambda key: f"Bearer {key[:-1]}",
    lambda key: f"Basic {key}",
    lambda key: key,
    lambda key: "Bearer",
)
# Requests outside the OpenAPI document: (method, path, status without a key, with the key).
# With a key, FastAPI's pages are off (404); the schema is served to key holders only.
_OUTSIDE_SCHEMA = (
    ("GET", "/openapi.json", 200, 200),
    ("GET", "/docs", 200, 404),
    ("GET", "/redoc", 200, 404),
    ("GET", "/no/such/path", 404, 404),
    ("GET", "/v1/completions", 405, 405),
    ("DELETE", "/v1/chat/completions", 405, 405),
    ("POST", "/v1/models", 405, 405),
)
_AS_GENERATED = object()  # send the Authorization header schemathesis generated, if any


@dataclass
class ServerUnderTest:
    """A server to fuzz: where it is, its key, how to tell it is alive, how to restart it."""

    setup: str  # a name for the summary: "no key", "api key"
    url: str
    api_key: str | None
    is_healthy: Callable[[], bool]
    restart: Callable[[], str] | None = None  # starts it again; returns the new URL


class Sender:
    """Sends cases to one server and records every answer and violation in ``summary``."""

    def __init__(self, server: ServerUnderTest, summary: FuzzSummary) -> None:
        from schemathesis.checks import not_a_server_error
        from schemathesis.specs.openapi.checks import (
            content_type_conformance,
            negative_data_rejection,
            response_schema_conformance,
            status_code_conformance,
        )

        self.server = server
        self.summary = summary
        self.first_case = summary.cases
        # Set when the server died and cannot be restarted: later cases are not sent.
        self.gave_up = False
        self.session = requests.Session()
        self.session.trust_env = False  # no proxy from the environment
        self.schema_checks = [
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
            negative_data_rejection,
        ]

    def send_case(self, case: Any) -> None:
        """Send a generated case (with the key, when there is one), and check the answer."""
        from schemathesis.core.parameters import ParameterLocation
        from schemathesis.generation.meta import negated_parameters

        if self.gave_up:
            return
        self.summary.cases += 1
        if self.summary.cases % PROGRESS_EVERY == 0:
            print(f"{self.summary.cases} cases sent...", file=sys.stderr, flush=True)
        key = self.server.api_key
        # A case made invalid by its headers breaks the Authorization header: send it as it is.
        breaks_auth = any(
            location == ParameterLocation.HEADER for _, location in negated_parameters(case.meta)
        )
        if key is None or breaks_auth:
            self._send(case, _AS_GENERATED, schema_checks=True)
            return
        self._send(case, f"Bearer {key}", schema_checks=True)
        number = self.summary.cases - self.first_case
        if number % AUTH_PROBE_EVERY == 0:
            wrong = _WRONG_AUTHORIZATION[(number // AUTH_PROBE_EVERY) % len(_WRONG_AUTHORIZATION)]
            self._send(case, wrong(key), schema_checks=False)

    def _send(self, case: Any, authorization: object, *, schema_checks: bool) -> None:
        kwargs = case.as_transport_kwargs(base_url=self.server.url)
        headers = dict(kwargs.pop("headers", None) or {})
        if authorization is None:
            headers.pop("Authorization", None)
        elif authorization is not _AS_GENERATED:
            headers["Authorization"] = authorization
        route = f"{case.method.upper()} {case.path}"
        key = self.server.api_key
        unauthorized = key is not None and headers.get("Authorization") != f"Bearer {key}"
        reproduce = curl_command(kwargs, headers, self.server.api_key)
        response = self._request(route, reproduce, headers=headers, **kwargs)
        if response is None:
            return
        self._check(route, response, unauthorized, reproduce)
        if schema_checks:
            self._schema_check(case, route, response, reproduce)

    def _request(self, route: str, reproduce: str, **kwargs: Any) -> requests.Response | None:
        try:
            return self.session.request(**kwargs, timeout=REQUEST_TIMEOUT_S)
        except requests.exceptions.InvalidHeader:
            return None  # the client itself refused to send it
        except requests.Timeout:
            self._fail(
                route, Violation("timeout", f"no answer in {REQUEST_TIMEOUT_S:g} s"), reproduce
            )
        except requests.ConnectionError as exc:
            self._connection_lost(route, exc, reproduce)
        return None

    def _check(
        self, route: str, response: requests.Response, unauthorized: bool, reproduce: str
    ) -> None:
        content_type = response.headers.get("content-type", "")
        streamed = response.status_code == 200 and content_type.startswith("text/event-stream")
        self.summary.count(self.server.setup, route, response.status_code, streamed)
        answer = Answer(response.status_code, content_type, response.content)
        path = route.split(" ", 1)[1]
        for violation in check_answer(path, answer, expect_unauthorized=unauthorized):
            self._fail(route, violation, reproduce)

    def _schema_check(
        self, case: Any, route: str, response: requests.Response, reproduce: str
    ) -> None:
        from schemathesis.core.failures import Failure, FailureGroup

        try:
            case.validate_response(response, checks=self.schema_checks)
        except FailureGroup as group:
            for failure in group.exceptions:
                self._fail(route, _schema_violation(failure), reproduce)
        except Failure as failure:
            self._fail(route, _schema_violation(failure), reproduce)

    def _connection_lost(self, route: str, exc: Exception, reproduce: str) -> None:
        if self.server.is_healthy():
            self._fail(route, Violation("dropped", f"connection lost: {exc}"), reproduce)
            return
        self._fail(route, Violation("crash", f"the server died: {exc}"), reproduce)
        if self.server.restart is None:
            self.gave_up = True
        else:
            self.server.url = self.server.restart()

    def _fail(self, route: str, violation: Violation, reproduce: str) -> None:
        self.summary.fail(self.server.setup, route, violation, reproduce)

    def probe_outside_schema(self) -> None:
        """Requests no schema describes: FastAPI's pages, unknown paths, wrong methods."""
        if self.gave_up:
            return
        key = self.server.api_key
        for method, path, status_open, status_keyed in _OUTSIDE_SCHEMA:
            for authorization in [None] if key is None else [f"Bearer {key}", None]:
                headers = {} if authorization is None else {"Authorization": authorization}
                route = f"{method} {path}"
                reproduce = f"curl -X {method} {self.server.url}{path}"
                response = self._request(
                    route, reproduce, method=method, url=self.server.url + path, headers=headers
                )
                if response is None:
                    continue
                unauthorized = key is not None and authorization is None
                self._check(route, response, unauthorized, reproduce)
                expected = 401 if unauthorized else (status_keyed if key else status_open)
                if response.status_code != expected:
                    detail = f"HTTP {response.status_code}, expected {expected}"
                    self._fail(route, Violation("status", detail), reproduce)

    def check_after_run(self) -> None:
        """The server is healthy and, once the last requests are done, holds nothing."""
        if self.gave_up:
            return
        if not self.server.is_healthy():
            self._fail("GET /health", Violation("crash", "unhealthy after the run"), "")
            return
        held = wait_until_idle(self.server.url, self.server.api_key, IDLE_TIMEOUT_S)
        if held:
            detail = f"after {IDLE_TIMEOUT_S:g} s without requests, still {held}"
            self._fail("GET /metrics", Violation("leak", detail), "")


def is_healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5.0).status_code == 200
    except requests.RequestException:
        return False


def wait_until_idle(url: str, api_key: str | None, timeout_s: float) -> dict[str, float]:
    """Wait until /metrics shows no KV block used and no sequence; what is still held, if any."""
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    deadline = time.monotonic() + timeout_s
    while True:
        text = requests.get(f"{url}/metrics", headers=headers, timeout=10.0).text
        values = {name: metric_value(text, name) for name in (BLOCKS_USED, RUNNING, WAITING)}
        held = {name: value for name, value in values.items() if value != 0}
        if not held or time.monotonic() > deadline:
            return held  # type: ignore[return-value]
        time.sleep(0.2)


def curl_command(kwargs: dict[str, Any], headers: dict[str, str], api_key: str | None) -> str:
    """The request as a curl command line; the key, if sent, shows as ``$API_KEY``.

    Not schemathesis's own: it hides every field whose name looks secret
    (``min_tokens``, ``stop_token_ids``), so its commands would send other requests.
    """
    parts = ["curl", "-X", kwargs["method"], kwargs["url"]]
    for name, value in headers.items():
        if name.lower() in ("content-type", "authorization"):
            if api_key is not None:
                value = value.replace(api_key, "$API_KEY")
            parts += ["-H", f"{name}: {value}"]
    if "json" in kwargs:
        parts += ["-d", json.dumps(kwargs["json"])]
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        parts += ["--data-binary", data.decode("latin-1") if isinstance(data, bytes) else str(data)]
    return " ".join(shlex.quote(part) if "$API_KEY" not in part else f'"{part}"' for part in parts)


def _schema_violation(failure: Any) -> Violation:
    message = str(getattr(failure, "message", "") or "").strip().splitlines()
    return Violation("schema", f"{failure.title}: {' / '.join(message[:3])}")
