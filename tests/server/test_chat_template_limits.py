"""A hostile chat template costs a 400 per request, never a stuck tokenizer thread or a 500.

The templates here are installed on the running engine's tokenizer directly,
past the check at load: that is where a template lands that is fine on the
load check's sample conversations and turns on a particular request.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.cli import build_parser
from kvserve.entrypoints.openai import cli_serve, uvicorn_server
from live_server import LiveServer
from model_fixtures import TINY_CHAT_TEMPLATE, save_tiny_model, train_tiny_tokenizer

NESTED_RANGES = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
# Quadratic in a message's length: fine on short messages, past the limit on a long one.
PER_CHARACTER = (
    "{% for m in messages %}{% for c in m.content %}{% for d in m.content %}"
    "{% endfor %}{% endfor %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)
SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = {"messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 2}
# Far from the seconds a stuck request would take; the refusals themselves take milliseconds.
TIMEOUT = 60


@pytest.fixture(scope="module")
def server(start_tiny_server: Callable[..., LiveServer]) -> LiveServer:
    return start_tiny_server()


@pytest.fixture(autouse=True)
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read at each render: the refusals come after 20,000 steps, not the default million.
    monkeypatch.setenv("KVSERVE_CHAT_TEMPLATE_LIMITS", "steps=20000")


@pytest.fixture
def template(server: LiveServer) -> Iterator[Callable[[str], None]]:
    tokenizer = server.async_engine.tokenizer

    def install(text: str) -> None:
        tokenizer.chat_template = text

    yield install
    tokenizer.chat_template = TINY_CHAT_TEMPLATE


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)


def assert_template_refused(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and error["code"] == "chat_template"
    assert "chat template" in error["message"].lower()
    for word in words:
        assert word in error["message"]


def assert_still_serving(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    completion = post(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 2})
    assert completion.status_code == 200, completion.text
    assert post(server, "/tokenize", {"prompt": "Once upon"}).status_code == 200


def test_a_template_that_never_ends_gets_400_and_the_tokenizer_thread_is_free(
    server: LiveServer, template: Callable[[str], None]
) -> None:
    template(NESTED_RANGES)
    for _ in range(2):  # the second is refused as quickly: nothing holds the thread
        assert_template_refused(post(server, "/v1/chat/completions", SHORT), "steps")
        assert_still_serving(server)
    tokenize = post(server, "/tokenize", {"messages": SHORT["messages"]})
    assert_template_refused(tokenize, "steps")


def test_a_template_fine_on_short_messages_refuses_only_the_long_one(
    server: LiveServer, template: Callable[[str], None]
) -> None:
    template(PER_CHARACTER)
    assert post(server, "/v1/chat/completions", SHORT).status_code == 200
    assert_template_refused(post(server, "/v1/chat/completions", LONG), "steps")
    streamed = post(server, "/v1/chat/completions", {**LONG, "stream": True})
    assert_template_refused(streamed, "steps")  # refused before the stream starts
    assert post(server, "/v1/chat/completions", SHORT).status_code == 200
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{{ 'x' * 1000000000 }}", ["1000000000"]),
        ("{{ 2.0 ** 100000 }}", ["OverflowError"]),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ["RecursionError"]),
        ("{{ messages.append(1) }}", ["sandbox"]),
        ("{{ raise_exception('roles must alternate') }}", ["roles must alternate"]),
    ],
)
def test_every_template_error_is_a_400_naming_the_chat_template(
    server: LiveServer, template: Callable[[str], None], text: str, words: list[str]
) -> None:
    template(text)
    assert_template_refused(post(server, "/v1/chat/completions", SHORT), *words)
    assert_still_serving(server)


def serve_args(model: Path, *flags: str) -> Any:
    engine_flags = ["--dtype", "float32", "--num-blocks", "64", "--block-size", "4"]
    return build_parser().parse_args(["serve", "--model", str(model), *engine_flags, *flags])


def test_serve_refuses_a_hostile_template_at_start_up(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(uvicorn_server, "serve", lambda app, **options: pytest.fail("served"))
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the test process goes on afterwards
    with pytest.raises(SystemExit, match="chat_template: the chat template went past its limits"):
        cli_serve.run_serve(serve_args(tiny_model_dir, "--chat-template", NESTED_RANGES))
    tokenizer = train_tiny_tokenizer()
    tokenizer.chat_template = NESTED_RANGES
    hostile_model = save_tiny_model(tmp_path / "hostile", "llama", tokenizer)
    with pytest.raises(SystemExit, match=r"cannot load .* the chat template went past its limits"):
        cli_serve.run_serve(serve_args(hostile_model))
