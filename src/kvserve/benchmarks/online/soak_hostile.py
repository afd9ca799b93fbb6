"""The hostile clients of ``kvserve bench soak`` that the main server gets (``--hostile``).

They only send and count: whatever the server answers is recorded, and the
report says which answers a hardened server gives.

- ``slow-body``: a raw connection sends a request head whose Content-Length
  promises more body than ever comes, then trickles a byte a second or
  stalls, for ``--slow-body-seconds``. Outcomes: the status the server
  answered with before closing (a 408 or 400 is the hardened answer),
  ``closed`` (it hung up without one), or ``kept open`` (it still waited
  when the client gave up: one connection slot held that long). Any of the
  three is accepted today; a 5xx is not.
- ``grammar``: a completion constrained by a regular expression whose
  repetitions multiply past any sane automaton (``a{1000}{1000}``,
  ``((a{100}){100}){100}``), so the grammar fails while it is compiled or
  used. A 4xx is the right answer; a 5xx, or an error event inside a
  stream, is a failure. A 200 (the grammar served after all) is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx

from kvserve.benchmarks.online.serve_client import auth_headers
from kvserve.benchmarks.online.soak_requests import (
    ANY_4XX,
    Kind,
    Outcome,
    SoakTarget,
    read_stream,
    status_outcome,
)

SLOW_BODY = "slow-body"
GRAMMAR = "grammar"
KEPT_OPEN = "kept open"
CLOSED = "closed"

HOSTILE_KINDS = (
    Kind(
        SLOW_BODY,
        3,
        False,
        frozenset({ANY_4XX, CLOSED, KEPT_OPEN}),
        "a body shorter than its Content-Length, trickled or stalled",
    ),
    Kind(
        GRAMMAR,
        5,
        False,
        frozenset({ANY_4XX, "200"}),
        "a regex grammar that fails when compiled or used",
    ),
)

# Bytes the slow body declares; it never sends more than one a second, so never all.
_DECLARED_BODY_BYTES = 4096
RUNTIME_FAILING_GRAMMARS = ("a{1000}{1000}", "((a{100}){100}){100}")


async def send_hostile(
    kind: Kind,
    client: httpx.AsyncClient,
    soak: SoakTarget,
    rng: random.Random,
    slow_body_s: float,
) -> Outcome:
    """Send one request of a hostile ``kind``; its outcome. Never raises for the server's answers."""
    try:
        if kind.name == SLOW_BODY:
            return await slow_body(soak, trickle=rng.random() < 0.5, duration_s=slow_body_s)
        if kind.name == GRAMMAR:
            return await runtime_failing_grammar(client, soak, rng)
    except (httpx.TimeoutException, asyncio.TimeoutError):
        return Outcome("timeout")
    except (httpx.HTTPError, OSError) as exc:
        return Outcome("transport error", f"{type(exc).__name__}: {exc}"[:200])
    raise ValueError(f"unknown hostile kind {kind.name!r}")


async def slow_body(soak: SoakTarget, trickle: bool, duration_s: float) -> Outcome:
    """A request whose body never arrives in full: what the server does about it."""
    url = httpx.URL(soak.base_url.rstrip("/") + "/completions")
    secure = url.scheme == "https"
    port = url.port or (443 if secure else 80)
    reader, writer = await asyncio.open_connection(url.host, port, ssl=True if secure else None)
    headers = {
        "Host": f"{url.host}:{port}",
        "Content-Type": "application/json",
        "Content-Length": str(_DECLARED_BODY_BYTES),
        **auth_headers(soak.api_key),
    }
    head = f"POST {url.raw_path.decode('ascii')} HTTP/1.1\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    answer = asyncio.ensure_future(reader.read(4096))
    try:
        writer.write(head.encode("ascii") + b'{"prompt": "')
        await writer.drain()
        deadline = asyncio.get_running_loop().time() + duration_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return Outcome(KEPT_OPEN)
            done, _ = await asyncio.wait({answer}, timeout=min(1.0, left))
            if done:
                return _answer_outcome(answer.result())
            if trickle:
                writer.write(b"a")
                await writer.drain()
    except (ConnectionError, OSError):
        return Outcome(CLOSED)  # the server hung up while the client was still sending
    finally:
        answer.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)


def _answer_outcome(data: bytes) -> Outcome:
    """``closed`` for no answer, else the status of the response's first line."""
    if not data:
        return Outcome(CLOSED)
    status_line = data.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split()
    if len(parts) >= 2 and parts[0].startswith("HTTP/") and parts[1].isdigit():
        return Outcome(parts[1], status_line[:200])
    return Outcome("bad answer", status_line[:200])


async def runtime_failing_grammar(
    client: httpx.AsyncClient, soak: SoakTarget, rng: random.Random
) -> Outcome:
    """A completion constrained by one of ``RUNTIME_FAILING_GRAMMARS``, streamed or not."""
    url = soak.base_url.rstrip("/") + "/completions"
    body = {
        "model": soak.model,
        "prompt": "Write the letter a many times:",
        "max_tokens": soak.max_tokens,
        "structured_outputs": {"regex": rng.choice(RUNTIME_FAILING_GRAMMARS)},
    }
    headers = auth_headers(soak.api_key)
    if rng.random() < 0.5:
        response = await client.post(url, json=body, headers=headers)
        return status_outcome(response)
    body["stream"] = True
    async with client.stream("POST", url, json=body, headers=headers) as response:
        return await read_stream(response, stop_after=None)
