"""The API fuzzer's checks catch what they are meant to catch, and its reports replay."""

from __future__ import annotations

import json
import shlex

from fuzz.api_checks import Answer, check_answer, sse_data
from fuzz.api_sender import curl_command

JSON = "application/json"
SSE = "text/event-stream"


def error(status: int, **fields: object) -> Answer:
    info = {"message": "no", "type": "invalid_request_error", "param": None, "code": None}
    return Answer(status, JSON, json.dumps({"error": {**info, **fields}}).encode())


def kinds(answer: Answer, path: str = "/v1/completions", unauthorized: bool = False) -> list[str]:
    return [v.kind for v in check_answer(path, answer, expect_unauthorized=unauthorized)]


def test_an_openai_error_passes_and_a_5xx_never_does() -> None:
    assert kinds(error(400, param="n")) == []
    assert kinds(error(500, type="server_error")) == ["5xx"]


def test_error_bodies_out_of_shape_are_flagged() -> None:
    assert kinds(error(400, type="server_error")) == ["error shape"]  # a 4xx is the client's
    assert kinds(error(400, message="")) == ["error shape"]
    assert kinds(error(400, code=3)) == ["error shape"]
    assert kinds(Answer(404, JSON, b'{"detail": "Not Found"}')) == ["error shape"]
    assert kinds(Answer(400, JSON, b'{"error": {"message": "x"}}')) == ["error shape"]
    assert kinds(Answer(400, "text/plain", b"Bad Request")) == ["error shape"]
    assert kinds(Answer(422, JSON, b"not json")) == ["error shape"]


def test_without_the_key_only_401_invalid_api_key_will_do() -> None:
    assert kinds(error(401, code="invalid_api_key"), unauthorized=True) == []
    assert kinds(error(401, code="other"), unauthorized=True) == ["auth"]
    assert kinds(Answer(200, JSON, b"{}"), unauthorized=True) == ["auth"]
    assert kinds(Answer(200, JSON, b"{}"), path="/health", unauthorized=True) == []


def test_streams_must_end_with_done_and_carry_no_error_event() -> None:
    chunk = 'data: {"choices": []}\n\n'
    assert kinds(Answer(200, SSE, (chunk + "data: [DONE]\n\n").encode())) == []
    assert kinds(Answer(200, SSE, chunk.encode())) == ["stream"]
    failure = {"error": {"message": "m", "type": "server_error", "param": None, "code": None}}
    body = f"{chunk}data: {json.dumps(failure)}\n\ndata: [DONE]\n\n"
    assert kinds(Answer(200, SSE, body.encode())) == ["5xx"]
    assert kinds(Answer(200, SSE, b"data: [1]\n\ndata: [DONE]\n\n")) == ["stream"]


def test_response_streams_must_count_their_events_and_end_the_response() -> None:
    def stream(*types: str, numbers: list[int] | None = None) -> Answer:
        numbers = list(range(len(types))) if numbers is None else numbers
        events = [
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n})}\n\n"
            for kind, n in zip(types, numbers, strict=True)
        ]
        return Answer(200, SSE, "".join(events).encode())

    def problems(answer: Answer) -> list[str]:
        return kinds(answer, path="/v1/responses")

    assert problems(stream("response.created", "response.completed")) == []
    assert problems(stream("response.created", "response.incomplete")) == []
    assert problems(stream("response.created")) == ["stream"]
    assert problems(stream("response.created", "error")) == ["5xx", "stream"]
    misnumbered = stream("response.created", "response.completed", numbers=[0, 2])
    assert "stream" in problems(misnumbered)


def test_sse_data_joins_multi_line_events() -> None:
    assert sse_data("data: a\ndata: b\n\n: comment\n\ndata:[DONE]\n\n") == ["a\nb", "[DONE]"]


def test_a_failure_is_reported_as_a_curl_command_that_sends_the_same_request() -> None:
    kwargs = {"method": "POST", "url": "http://h/v1/completions", "json": {"min_tokens": 3}}
    headers = {"Authorization": "Bearer k3y", "Content-Type": "application/json", "X-Id": "1"}
    command = curl_command(kwargs, headers, api_key="k3y")
    assert "k3y" not in command and '"Authorization: Bearer $API_KEY"' in command
    words = shlex.split(command.replace("$API_KEY", "KEY"))
    assert words[:4] == ["curl", "-X", "POST", "http://h/v1/completions"]
    assert json.loads(words[words.index("-d") + 1]) == {"min_tokens": 3}
