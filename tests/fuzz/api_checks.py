"""What every answer of kvserve's HTTP API must satisfy, whatever the request was.

The API fuzzer (:mod:`fuzz.api_fuzz`) sends generated requests and checks
each answer here, beside schemathesis's own checks against the OpenAPI
document:

- no 5xx: the fuzzer's requests are all answerable, and a bad one is the
  client's fault (4xx); a stream that fails after its 200 reports the
  failure in an error event, which counts as a 5xx too;
- every error body is OpenAI's: ``{"error": {"message", "type", "param",
  "code"}}`` and nothing else, with ``type`` ``invalid_request_error`` for
  a 4xx and ``server_error`` for a 5xx (``api_errors.ApiError``);
- with an API key, a request without the right one gets 401 with code
  ``invalid_api_key``, on every path but /health;
- a stream is Server-Sent Events of JSON objects ending with ``data: [DONE]``;
  a /v1/responses stream instead ends with its ``response.completed`` or
  ``response.incomplete`` event, and its events count up from 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ERROR_FIELDS = frozenset({"message", "type", "param", "code"})
OPEN_PATHS = frozenset({"/health"})  # the only path that never needs the key


@dataclass(frozen=True)
class Violation:
    """One broken property: ``kind`` groups them in the summary, ``detail`` says what was seen."""

    kind: str  # "5xx", "error shape", "auth", "stream", "schema", "crash", "timeout"
    detail: str


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, reduced to what the checks read."""

    status: int
    content_type: str
    body: bytes


def check_answer(path: str, answer: Answer, *, expect_unauthorized: bool) -> list[Violation]:
    """The properties ``answer`` (to a request for ``path``) breaks; empty when it is sound.

    ``expect_unauthorized``: the server has a key and the request did not carry one of its keys.
    """
    found: list[Violation] = []
    status = answer.status
    if status >= 500:
        found.append(Violation("5xx", f"HTTP {status}: {_excerpt(answer.body)}"))
    if expect_unauthorized and path not in OPEN_PATHS:
        if status != 401:
            found.append(Violation("auth", f"HTTP {status} without a valid key, not 401"))
        elif (code := _error_code(answer.body)) != "invalid_api_key":
            found.append(Violation("auth", f"401 with code {code!r}, not 'invalid_api_key'"))
    if status >= 400:
        found += [Violation("error shape", problem) for problem in error_shape_problems(answer)]
    elif status == 200 and answer.content_type.startswith("text/event-stream"):
        if path == "/v1/responses":
            found += response_stream_violations(answer.body)
        else:
            found += stream_violations(answer.body)
    return found


def error_shape_problems(answer: Answer) -> list[str]:
    """What is wrong with an error answer's body; empty when it is OpenAI's error shape."""
    if not answer.content_type.startswith("application/json"):
        return [f"content type {answer.content_type!r}, not JSON: {_excerpt(answer.body)}"]
    try:
        document = json.loads(answer.body)
    except ValueError:
        return [f"a body that is not JSON: {_excerpt(answer.body)}"]
    return error_object_problems(document, answer.status)


def error_object_problems(document: Any, status: int | None) -> list[str]:
    """What keeps ``document`` from being ``{"error": {...}}`` as kvserve sends it.

    ``status`` decides the expected ``type``; None (an error event inside a
    stream, sent after a 200) expects ``server_error``.
    """
    if not isinstance(document, dict) or set(document) != {"error"}:
        return [f"not an object with just 'error': {_excerpt(json.dumps(document).encode())}"]
    error = document["error"]
    if not isinstance(error, dict) or set(error) != ERROR_FIELDS:
        keys = sorted(error) if isinstance(error, dict) else type(error).__name__
        return [f"'error' must have exactly {sorted(ERROR_FIELDS)}, has {keys}"]
    problems = []
    if not isinstance(error["message"], str) or not error["message"]:
        problems.append("'message' must be a non-empty string")
    expected_type = "server_error" if status is None or status >= 500 else "invalid_request_error"
    if error["type"] != expected_type:
        problems.append(f"'type' is {error['type']!r}, expected {expected_type!r}")
    for name in ("param", "code"):
        if error[name] is not None and not isinstance(error[name], str):
            problems.append(f"{name!r} must be a string or null, is {error[name]!r}")
    return problems


def stream_violations(body: bytes) -> list[Violation]:
    """A streamed 200: JSON object events, no error event, ``[DONE]`` last and only last."""
    events = sse_data(body.decode("utf-8", errors="replace"))
    if not events or events[-1] != "[DONE]":
        return [Violation("stream", f"the stream does not end with [DONE]: {_excerpt(body)}")]
    found = []
    for data in events[:-1]:
        try:
            event = json.loads(data)
        except ValueError:
            found.append(Violation("stream", f"an event that is not JSON: {data[:200]}"))
            continue
        if not isinstance(event, dict):
            found.append(Violation("stream", f"an event that is not an object: {data[:200]}"))
        elif "error" in event:
            # The stream's 200 was sent already: this is how a server failure shows.
            found.append(Violation("5xx", f"an error event in a stream: {data[:200]}"))
            found += [Violation("error shape", p) for p in error_object_problems(event, None)]
    return found


def response_stream_violations(body: bytes) -> list[Violation]:
    """A streamed /v1/responses 200: typed JSON events numbered from 0, no error, a final event."""
    found = []
    kinds = []
    for index, data in enumerate(sse_data(body.decode("utf-8", errors="replace"))):
        try:
            event = json.loads(data)
        except ValueError:
            found.append(Violation("stream", f"an event that is not JSON: {data[:200]}"))
            continue
        if not isinstance(event, dict) or event.get("sequence_number") != index:
            found.append(
                Violation("stream", f"event {index} is not numbered {index}: {data[:200]}")
            )
            continue
        kinds.append(event.get("type"))
        if event.get("type") == "error":
            found.append(Violation("5xx", f"an error event in a stream: {data[:200]}"))
    if not kinds or kinds[-1] not in ("response.completed", "response.incomplete"):
        found.append(Violation("stream", f"the stream does not end its response: {_excerpt(body)}"))
    return found


def sse_data(text: str) -> list[str]:
    """The ``data:`` of each event of a whole Server-Sent Events body."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [
            line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")
        ]
        if lines:
            events.append("\n".join(lines))
    return events


def _error_code(body: bytes) -> object:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _excerpt(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "..."
