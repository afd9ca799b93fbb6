"""API keys (constant-time Bearer check on every path but /health) and the serve command's flags."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import openai
import pytest

from kvserve.entrypoints.args import engine_config_from_args, server_config_from_args
from kvserve.entrypoints.openai.cli_serve import add_serve_parser
from kvserve.errors import InvalidParameterError

API_KEY = "s3cret-kvserve-key"
OTHER_KEY = "another-tenant-key"
BODY = {"prompt": "The quick", "max_tokens": 3}
# Every path but /health needs a key: the API, FastAPI's own pages, and paths that do not exist.
PROTECTED = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
    ("GET", "/no/such/path"),
    ("GET", "/health/"),
]


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    server = start_tiny_server(api_keys=(API_KEY, OTHER_KEY))
    server.headers = {"Authorization": f"Bearer {API_KEY}"}
    return server


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-key",
        f"Bearer {API_KEY[:-1]}",
        f"Bearer {API_KEY}x",
        f"Basic {API_KEY}",
        API_KEY,
        "Bearer",
    ],
)
def test_a_missing_or_wrong_key_gets_401(server: Any, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in PROTECTED:
        response = httpx.request(method, server.url + path, json=BODY, headers=headers)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert server.async_engine.engine.has_unfinished_requests() is False


def test_each_key_works_and_health_needs_none(server: Any) -> None:
    for key in (API_KEY, OTHER_KEY):
        headers = {"Authorization": f"Bearer {key}"}
        response = httpx.post(f"{server.url}/v1/completions", json=BODY, headers=headers)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_schema_is_served_behind_the_key_and_the_docs_pages_are_off(server: Any) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", headers=server.headers)
    assert schema.status_code == 200
    assert "/v1/chat/completions" in schema.json()["paths"]
    # A browser loading these pages could not send the key to fetch the schema.
    for path in ("/docs", "/redoc"):
        response = httpx.get(server.url + path, headers=server.headers)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_without_a_key_the_docs_pages_are_served(start_tiny_server: Any) -> None:
    open_server = start_tiny_server()
    assert httpx.get(f"{open_server.url}/docs").status_code == 200
    assert httpx.get(f"{open_server.url}/openapi.json").status_code == 200


def test_the_openai_client_sends_the_key(server: Any) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    assert [model.id for model in client.models.list()] == ["tiny"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_default_to_loopback_and_the_documented_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    args = parse()
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    config = server_config_from_args(args)
    assert config.api_keys == () and config.salt_cache_by_api_key is False
    assert config.served_model_name == "smollm2-135m-instruct"
    assert (config.max_n, config.max_waiting_requests) == (8, 256)
    assert config.max_request_body_bytes == 1024 * 1024
    assert (config.max_stop_token_ids, config.max_chat_messages) == (128, 512)
    assert (config.limit_concurrency, config.limit_concurrency_per_peer) == (512, 64)
    assert (config.timeout_keep_alive, config.timeout_header) == (5.0, 10.0)
    assert (config.timeout_body, config.min_body_rate, config.timeout_write) == (10.0, 4096, 30.0)


def test_api_keys_come_from_the_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert server_config_from_args(parse()).api_keys == ("from-env",)
    assert server_config_from_args(parse("--api-key", "from-flag")).api_keys == ("from-flag",)
    config = server_config_from_args(
        parse("--api-key", "one", "--api-key", "two", "--salt-cache-by-api-key")
    )
    assert config.api_keys == ("one", "two") and config.salt_cache_by_api_key is True


def test_salting_by_key_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    with pytest.raises(InvalidParameterError) as error:
        server_config_from_args(parse("--salt-cache-by-api-key"))
    assert error.value.param == "salt_cache_by_api_key"


def test_connection_limits_come_from_their_flags() -> None:
    args = parse(
        "--limit-concurrency", "64", "--timeout-keep-alive", "2.5", "--timeout-header", "3"
    )
    config = server_config_from_args(args)
    assert (config.limit_concurrency, config.timeout_keep_alive, config.timeout_header) == (
        64,
        2.5,
        3.0,
    )
    with pytest.raises(InvalidParameterError) as error:
        server_config_from_args(parse("--timeout-header", "0"))
    assert error.value.param == "timeout_header"
    args = parse(
        "--limit-concurrency-per-peer", "8", "--timeout-body", "4.5", "--min-body-rate", "512",
        "--timeout-write", "12",
    )  # fmt: skip
    config = server_config_from_args(args)
    assert config.limit_concurrency_per_peer == 8
    assert (config.timeout_body, config.min_body_rate, config.timeout_write) == (4.5, 512, 12.0)
    for flag, value, param in [
        ("--timeout-body", "0", "timeout_body"),
        ("--timeout-body", "nan", "timeout_body"),
        ("--min-body-rate", "0", "min_body_rate"),
        ("--limit-concurrency-per-peer", "-1", "limit_concurrency_per_peer"),
        ("--timeout-write", "inf", "timeout_write"),
    ]:
        with pytest.raises(InvalidParameterError) as error:
            server_config_from_args(parse(flag, value))
        assert error.value.param == param


def test_engine_flags_come_from_the_config_dataclasses() -> None:
    args = parse("--model", "some-model", "--max-num-seqs", "7", "--no-chunked-prefill")
    config = engine_config_from_args(args)
    assert config.model_config.model == "some-model"
    assert config.scheduler_config.max_num_seqs == 7
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.cache_config.block_size == 16


def test_help_documents_the_limits_and_the_open_health_endpoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "/health stays open" in text
    assert "--max-waiting-requests" in text and "(default: 256)" in text
    assert "--max-request-body-bytes" in text and "(default: 1048576)" in text
    assert "--host HOST address to bind (default: 127.0.0.1)" in text
    assert "repeat it to accept several keys" in text and "--salt-cache-by-api-key" in text
    assert "--max-stop-token-ids" in text and "(default: 128)" in text
    assert "--max-chat-messages" in text and "(default: 512)" in text
    assert "--limit-concurrency" in text and "--timeout-keep-alive" in text
    assert "--timeout-header" in text and "(default: 10.0)" in text
    assert "--limit-concurrency-per-peer" in text and "(default: 64)" in text
    assert "--timeout-body" in text and "--min-body-rate" in text and "(default: 4096)" in text
    assert "--timeout-write" in text and "(default: 30.0)" in text
