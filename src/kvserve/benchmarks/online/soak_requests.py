"""The requests of ``kvserve bench soak``: what each kind sends, and the answers it expects.

Every request ends in an *outcome*: the HTTP status (``"200"``, ``"413"``),
``"disconnected"`` (the client left on purpose), or what went wrong:
``"error event"`` (a stream that failed after its 200), ``"incomplete
stream"``, ``"bad body"``, ``"timeout"``, ``"transport error"``. Each kind
names the outcomes it expects; anything else is a failure of the server.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvserve.benchmarks.online.serve_client import Endpoint, Target
from kvserve.benchmarks.online.sse import sse_events, sse_lines
from kvserve.benchmarks.workloads.prompts import Prompt
from kvserve.benchmarks.workloads.text import random_words

DISCONNECTED = "disconnected"
_DETAIL_CHARS = 200
# Bodies the server must refuse with 400: broken JSON, wrong types, unknown fields, bad values.
MALFORMED_BODIES = (
    b"{",
    b"not json at all",
    b'{"prompt": "unterminated',
    b"\xff\xfe\x00{}",
    b"[]",
    b"null",
    b'{"prompt": 5}',
    b'{"prompt": "Hi", "max_tokens": "16"}',
    b'{"prompt": "Hi", "max_token": 16}',
    b'{"prompt": "Hi", "temperature": -1}',
    b'{"prompt": "Hi", "n": 100000}',
    b'{"prompt": [[1, 2], "mixed"], "max_tokens": 1e999}',
    b'{"messages": "Hi"}',
    b'{"messages": []}',
    b'{"messages": [{"role": "robot", "content": "Hi"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
)


ANY_4XX = "4xx"  # in a kind's expected outcomes: any status from 400 to 499


@dataclass(frozen=True)
class Kind:
    """A kind of request: how often it is sent, whether it is valid, what answers it expects."""

    name: str
    weight: int
    valid: bool  # a well-formed request the server must serve (its 5xx are what soak counts)
    expected: frozenset[str]
    about: str

    def expects(self, outcome: str) -> bool:
        if outcome in self.expected:
            return True
        return ANY_4XX in self.expected and outcome.isdigit() and 400 <= int(outcome) < 500


KINDS = (
    Kind("stream", 30, True, frozenset({"200"}), "streamed request read to data: [DONE]"),
    Kind("json", 20, True, frozenset({"200"}), "non-streamed request"),
    Kind(
        "preempt",
        15,
        True,
        frozenset({"200"}),
        "n > 1 and long max_tokens: with a small KV pool, sequences are preempted",
    ),
    Kind(
        "disconnect",
        15,
        False,
        frozenset({DISCONNECTED, "200"}),
        "streamed; the client leaves after a few events",
    ),
    Kind(
        "abandon",
        5,
        False,
        frozenset({DISCONNECTED, "200"}),
        "non-streamed long request; the client leaves before the answer",
    ),
    Kind("oversized", 5, False, frozenset({"413"}), "a body over the server's size limit"),
    Kind("malformed", 10, False, frozenset({"400"}), "broken JSON, wrong types, unknown fields"),
)
KINDS_BY_NAME = {kind.name: kind for kind in KINDS}


@dataclass(frozen=True)
class Outcome:
    """How one request ended; ``detail`` says more when it went wrong.

    output_tokens: the tokens an answered request generated (its ``usage``), else 0.
    """

    outcome: str
    detail: str | None = None
    output_tokens: int = 0


@dataclass(frozen=True)
class SoakTarget:
    """The server and the sizes of the requests sent to it."""

    base_url: str
    model: str
    api_key: str | None
    max_tokens: int  # normal requests
    long_max_tokens: int  # preempt and abandon
    preempt_n: int
    prompt_words: int
    oversized_bytes: int

    def target(self, rng: random.Random, max_tokens: int) -> Target:
        endpoint: Endpoint = "chat" if rng.random() < 0.5 else "completions"
        return Target(self.base_url, self.model, endpoint, max_tokens, self.api_key)


async def send(
    kind: Kind, client: httpx.AsyncClient, soak: SoakTarget, rng: random.Random
) -> Outcome:
    """Send one request of ``kind``; its outcome. Never raises for the server's answers."""
    try:
        return await _send(kind.name, client, soak, rng)
    except httpx.TimeoutException:
        return Outcome("timeout")
    except httpx.HTTPError as exc:
        return Outcome("transport error", f"{type(exc).__name__}: {exc}"[:_DETAIL_CHARS])


async def _send(
    name: str, client: httpx.AsyncClient, soak: SoakTarget, rng: random.Random
) -> Outcome:
    prompt = Prompt(None, random_words(rng, soak.prompt_words))
    if name == "oversized":
        return await _oversized(client, soak, chunked=rng.random() < 0.5)
    long = name in ("preempt", "abandon")
    target = soak.target(rng, soak.long_max_tokens if long else soak.max_tokens)
    body = target.body(prompt)  # streamed, greedy, ignore_eos: every token is generated
    if name == "stream":
        return await _stream(client, target, body, stop_after=None)
    if name == "disconnect":
        return await _stream(client, target, body, stop_after=rng.randint(1, 4))
    if name == "json":
        return await _post(client, target, _not_streamed(body), expected_choices=1)
    if name == "preempt":
        body = {**body, "n": soak.preempt_n, "temperature": 0.8, "seed": rng.randrange(2**31)}
        if rng.random() < 0.5:
            return await _stream(client, target, body, stop_after=None)
        return await _post(client, target, _not_streamed(body), expected_choices=soak.preempt_n)
    if name == "abandon":
        request = _post(client, target, _not_streamed(body), expected_choices=1)
        try:
            return await asyncio.wait_for(request, timeout=rng.uniform(0.05, 1.0))
        except asyncio.TimeoutError:
            return Outcome(DISCONNECTED)
    if name == "malformed":
        headers = {**target.headers, "Content-Type": "application/json"}
        content = rng.choice(MALFORMED_BODIES)
        return status_outcome(await client.post(target.url, content=content, headers=headers))
    raise ValueError(f"unknown request kind {name!r}")


def _not_streamed(body: dict[str, Any]) -> dict[str, Any]:
    without_options = {key: value for key, value in body.items() if key != "stream_options"}
    return {**without_options, "stream": False}


async def _post(
    client: httpx.AsyncClient, target: Target, body: dict[str, Any], expected_choices: int
) -> Outcome:
    response = await client.post(target.url, json=body, headers=target.headers)
    if response.status_code != 200:
        return status_outcome(response)
    try:
        choices = response.json()["choices"]
    except (ValueError, KeyError, TypeError):
        return Outcome("bad body", response.text[:_DETAIL_CHARS])
    if not isinstance(choices, list) or len(choices) != expected_choices:
        return Outcome("bad body", f"{expected_choices} choices expected: {response.text[:100]}")
    return Outcome("200", output_tokens=_completion_tokens(response.json()))


async def _stream(
    client: httpx.AsyncClient, target: Target, body: dict[str, Any], stop_after: int | None
) -> Outcome:
    """A streamed request, read to ``[DONE]`` or, with ``stop_after``, left after that many events."""
    async with client.stream("POST", target.url, json=body, headers=target.headers) as response:
        return await read_stream(response, stop_after)


async def read_stream(response: httpx.Response, stop_after: int | None) -> Outcome:
    """The outcome of a streamed answer, read inside its ``client.stream`` block: to
    ``[DONE]``, or left after ``stop_after`` events (leaving the block closes the connection)."""
    if response.status_code != 200:
        await response.aread()
        return status_outcome(response)
    num_events = output_tokens = 0
    async for data in sse_events(sse_lines(response.aiter_bytes())):
        if data == "[DONE]":
            return Outcome("200", output_tokens=output_tokens)
        try:
            event = json.loads(data)
        except ValueError:
            return Outcome("bad body", f"an event that is not JSON: {data[:100]}")
        if isinstance(event, dict) and "error" in event:
            return Outcome("error event", data[:_DETAIL_CHARS])
        output_tokens = _completion_tokens(event) or output_tokens  # the last event's usage
        num_events += 1
        if stop_after is not None and num_events >= stop_after:
            return Outcome(DISCONNECTED)  # mid-stream: the server must abort the request
    return Outcome("incomplete stream")


async def _oversized(client: httpx.AsyncClient, soak: SoakTarget, chunked: bool) -> Outcome:
    """A body past the limit, with a Content-Length or chunked (the server must count itself)."""
    target = Target(soak.base_url, soak.model, "completions", soak.max_tokens, soak.api_key)
    body = json.dumps({"prompt": "a" * soak.oversized_bytes, "max_tokens": 1}).encode()
    headers = {**target.headers, "Content-Type": "application/json"}
    if not chunked:
        return status_outcome(await client.post(target.url, content=body, headers=headers))

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    return status_outcome(await client.post(target.url, content=chunks(), headers=headers))


def _completion_tokens(body: Any) -> int:
    """``usage.completion_tokens`` of an answer or stream event; 0 where it is missing."""
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0


def status_outcome(response: httpx.Response) -> Outcome:
    if response.status_code == 200:
        return Outcome("200")
    return Outcome(str(response.status_code), response.text[:_DETAIL_CHARS])
