"""The client of ``kvserve bench serve``: streamed OpenAI-style requests, many at once.

It speaks only the protocol every OpenAI-compatible server shares: ``POST
{base}/chat/completions`` or ``{base}/completions`` with ``"stream": true``,
answered by Server-Sent Events ``data: {json}`` and a final ``data: [DONE]``.
So one client measures kvserve, llama.cpp's llama-server and vLLM alike. Each
request records when every event carrying generated text arrived; the
benchmark turns those times into TTFT, inter-token latency and chunk gaps.
A failure of any kind (an HTTP error, an error event inside the stream, a
timeout, a dropped connection) becomes the request's ``error``, never an
exception.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvserve.benchmarks.online.sse import sse_events, sse_lines
from kvserve.benchmarks.workloads.prompts import Prompt

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, str] = {"chat": "/chat/completions", "completions": "/completions"}

# Error messages are cut to this length: a proxy may answer with a whole HTML page.
_MAX_MESSAGE_CHARS = 300


class ServerError(Exception):
    """The server could not answer a question the benchmark needs answered before it starts."""


@dataclass(frozen=True)
class Target:
    """Where requests go and what each one asks for."""

    base_url: str
    model: str
    endpoint: Endpoint = "chat"
    max_tokens: int = 128
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def body(self, prompt: Prompt) -> dict[str, Any]:
        """The JSON body of the request for ``prompt``.

        Only fields kvserve's strict parser accepts: it refuses unknown ones.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            # Greedy, so every server and every repetition samples the same way.
            "temperature": 0.0,
            # vLLM's name, read by kvserve and llama-server too: no request stops
            # early, so every run and every server generates the same tokens.
            "ignore_eos": True,
            "stream": True,
            # The last event then carries usage.completion_tokens, the true count
            # even where a server packs several tokens into one event.
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = prompt.text
        else:
            system = [] if prompt.system is None else [{"role": "system", "content": prompt.system}]
            body["messages"] = [*system, {"role": "user", "content": prompt.user}]
        return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


@dataclass
class RequestRecord:
    """What one streamed request did. Times are ``time.perf_counter()`` seconds.

    start: when the request was sent (after it got its turn under the concurrency limit).
    chunk_times: when each event carrying generated text arrived; one event may
        carry several tokens, as servers coalesce them under load.
    usage_tokens: ``usage.completion_tokens`` from the stream, when the server sent it.
    error: why the request failed; None when it streamed to ``data: [DONE]``.
    """

    start: float
    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens generated: by usage where given, else one per text-carrying event."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first generated text; None if none came."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> float | None:
        """Mean seconds per token after the first; None below two tokens."""
        if not self.chunk_times or self.num_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.num_tokens - 1)

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive text-carrying events."""
        return [later - earlier for earlier, later in itertools.pairwise(self.chunk_times)]


@dataclass(frozen=True)
class RunRecord:
    """One pass over a list of prompts: its wall time and every request, in prompt order."""

    wall_s: float
    requests: list[RequestRecord]


def make_client(
    concurrency: int, timeout_s: float, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """An HTTP client with a connection for every request allowed in flight."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s),
        # Too few connections would queue requests inside the client, counted as TTFT.
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        # A proxy from the environment would carry the traffic elsewhere and skew every time.
        trust_env=False,
        transport=transport,
    )


async def list_models(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> list[str]:
    """The ids of ``GET {base_url}/models``; ServerError when the server will not say."""
    url = base_url.rstrip("/") + "/models"
    try:
        response = await client.get(url, headers=auth_headers(api_key))
    except httpx.HTTPError as exc:
        raise ServerError(f"GET {url}: {_describe(exc)}") from None
    if response.status_code != 200:
        raise ServerError(f"GET {url}: HTTP {response.status_code}: {_message(response.content)}")
    try:
        models = response.json()["data"]
        return [model["id"] for model in models if isinstance(model.get("id"), str)]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ServerError(f"GET {url}: not a model list: {_message(response.content)}") from None


async def stream_request(
    client: httpx.AsyncClient, target: Target, prompt: Prompt, timeout_s: float
) -> RequestRecord:
    """Send one streamed request and record its events; at most ``timeout_s`` seconds."""
    record = RequestRecord(start=time.perf_counter())
    try:
        await asyncio.wait_for(_stream_into(record, client, target, prompt), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
    return record


async def run_requests(
    client: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[Prompt],
    concurrency: int,
    timeout_s: float,
    max_duration_s: float,
) -> RunRecord:
    """Send every prompt, at most ``concurrency`` at a time, for at most ``max_duration_s``.

    Requests still running or waiting their turn at the cap are cancelled and
    recorded as failed.
    """
    if not prompts:
        return RunRecord(0.0, [])
    semaphore = asyncio.Semaphore(concurrency)

    async def send(prompt: Prompt) -> RequestRecord:
        async with semaphore:
            return await stream_request(client, target, prompt, timeout_s)

    start = time.perf_counter()
    tasks = [asyncio.ensure_future(send(prompt)) for prompt in prompts]
    done, pending = await asyncio.wait(tasks, timeout=max_duration_s)
    wall_s = time.perf_counter() - start
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    records = []
    for task in tasks:
        if task not in done:
            error = f"not finished when the run reached its {max_duration_s:g} s cap"
            records.append(RequestRecord(start=start, error=error))
        elif (exc := task.exception()) is not None:
            records.append(RequestRecord(start=start, error=_describe(exc)))
        else:
            records.append(task.result())
    return RunRecord(wall_s, records)


async def _stream_into(
    record: RequestRecord, client: httpx.AsyncClient, target: Target, prompt: Prompt
) -> None:
    try:
        async with client.stream(
            "POST", target.url, json=target.body(prompt), headers=target.headers
        ) as response:
            if response.status_code != 200:
                body = await response.aread()
                record.error = f"HTTP {response.status_code}: {_message(body)}"
                return
            async for data in sse_events(sse_lines(response.aiter_bytes())):
                if data == "[DONE]":
                    return
                _take_event(record, data, time.perf_counter())
                if record.error is not None:
                    return
        record.error = "the stream ended before data: [DONE]"
    except httpx.HTTPError as exc:
        record.error = _describe(exc)


def _take_event(record: RequestRecord, data: str, arrived: float) -> None:
    """Add one event's text and usage to ``record``; a broken or error event fails it."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        record.error = f"an event that is not JSON: {data[:_MAX_MESSAGE_CHARS]}"
        return
    if not isinstance(event, dict):
        record.error = f"an event that is not a JSON object: {data[:_MAX_MESSAGE_CHARS]}"
        return
    if event.get("error") is not None:
        # Once a stream has started, a server can only report a failure inside it.
        record.error = f"error event: {_message(data.encode())}"
        return
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        # Some servers send a running total in every event: the last one is the count.
        record.usage_tokens = usage["completion_tokens"]
    choices = event.get("choices")
    if isinstance(choices, list) and any(_generated_text(choice) for choice in choices):
        record.chunk_times.append(arrived)


def _generated_text(choice: object) -> str:
    """The text a streamed choice adds: a chat delta's content, or a completion's text."""
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        # Reasoning models stream their thinking beside the answer: both are generated tokens.
        parts = (delta.get("content"), delta.get("reasoning_content"))
        return "".join(part for part in parts if isinstance(part, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _message(body: bytes) -> str:
    """The message of an OpenAI-style error body ``{"error": {"message": ...}}``, else the body."""
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            text = error["message"]
        elif isinstance(error, str):
            text = error
        elif isinstance(parsed.get("detail"), str):  # FastAPI's own errors
            text = parsed["detail"]
    return text.strip()[:_MAX_MESSAGE_CHARS] or "(empty body)"


def _describe(exc: BaseException) -> str:
    """``ConnectError: [Errno 111] Connection refused``; the class alone when there is no text."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
