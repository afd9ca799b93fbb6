"""``kvserve serve``: load a model and serve the OpenAI API over HTTP.

``add_serve_parser(subparsers)`` adds the subcommand to the ``kvserve`` CLI;
``python -m kvserve.entrypoints.openai`` runs the same command on its own
(``__main__.py``). Engine flags are generated from the fields of
``ModelConfig``, ``CacheConfig`` and ``SchedulerConfig`` (``--max-num-seqs``);
the configs the flags describe are built in ``entrypoints/args.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import ipaddress
import logging
import sys
from typing import Any

from kvserve.config import EngineConfig
from kvserve.entrypoints.args import (
    API_KEY_ENV,
    add_chat_template_arg,
    add_engine_args,
    engine_config_from_args,
    read_chat_template,
    server_config_from_args,
)
from kvserve.entrypoints.openai import server_config as defaults
from kvserve.errors import InvalidParameterError
from kvserve.serve.ray.cli import add_ray_arguments
from kvserve.trace.cli import add_trace_arg, open_trace

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Serve a model over an OpenAI-compatible HTTP API: /v1/completions,
/v1/chat/completions (JSON or streamed as server-sent events), /v1/embeddings,
/v1/models,
/metrics (Prometheus) and /health. With an API key every endpoint except
/health needs 'Authorization: Bearer <key>'; /health stays open for probes.
"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except a None the help text explains and an on-off flag's."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # A flag's default only restates it: "--no-dashboard (default: True)" would mislead.
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags and the engine's, on ``parser``."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind")
    server.add_argument("--port", type=int, default=8000, help="port to bind")
    server.add_argument(
        "--served-model-name", help="the model name clients use (default: the --model value)"
    )
    server.add_argument(
        "--api-key",
        action="append",
        help=f"require 'Authorization: Bearer <key>'; repeat it to accept several keys "
        f"(default: ${API_KEY_ENV} if set, else no key); /health stays open",
    )
    server.add_argument(
        "--salt-cache-by-api-key",
        action="store_true",
        help="give each API key's requests a prefix cache of their own (a salt derived from "
        "the key), so clients with different keys cannot time each other's prompts",
    )
    limits: dict[str, tuple[type, str]] = {
        "max_request_body_bytes": (int, "larger request bodies get 413"),
        "max_n": (int, "the largest n a request may ask for"),
        "max_prompts_per_request": (int, "the most prompts in one /v1/completions request"),
        "max_stop_token_ids": (int, "the most stop_token_ids in one request"),
        "max_chat_messages": (int, "the most messages in one /v1/chat/completions request"),
        "max_waiting_requests": (
            int,
            "new requests get 503 + Retry-After when their sequences would take the "
            "sequences waiting past this",
        ),
        "limit_concurrency": (
            int,
            "connections open at once; past it, new requests get 503 (/health excepted)",
        ),
        "limit_concurrency_per_peer": (
            int,
            "connections one address (IPv6: one /64) may hold at once; requests on its newer "
            "ones get 503 (/health excepted); raise it to --limit-concurrency behind a proxy",
        ),
        "timeout_keep_alive": (float, "seconds an idle keep-alive connection stays open"),
        "timeout_header": (
            float,
            "seconds a client has to send a request's head before its connection is closed",
        ),
        "timeout_body": (
            float,
            "seconds a client has, once a request's head is in, to send the body, plus one "
            "per --min-body-rate bytes received; then 408 and the connection is closed",
        ),
        "min_body_rate": (int, "bytes per second a request body must keep up (see above)"),
        "timeout_write": (
            float,
            "seconds a client may read nothing of a response the server is sending; then "
            "its connection is closed",
        ),
    }
    for name, (kind, help_text) in limits.items():
        default = getattr(defaults, f"DEFAULT_{name.upper()}")
        flag = "--" + name.replace("_", "-")
        server.add_argument(flag, type=kind, default=default, help=help_text)
    add_chat_template_arg(server)
    server.add_argument(
        "--embedding-model",
        help="also serve this embedding model (an alias such as all-minilm-l6-v2, a folder or "
        "a hub id) on /v1/embeddings, beside --model; requests pick one by 'model', and "
        "/v1/models lists both. It runs with the same engine flags, its own context length",
    )
    server.add_argument(
        "--no-dashboard",
        dest="enable_dashboard",
        action="store_false",
        help="do not serve the live dashboard (GET /dashboard) and its state stream",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    add_engine_args(parser)
    add_trace_arg(parser)
    add_ray_arguments(parser)
    # Streams are waiting on every step: keep a new prompt's chunks short beside them.
    parser.set_defaults(
        max_prefill_tokens_while_decoding=defaults.DEFAULT_SERVE_PREFILL_TOKENS_WHILE_DECODING
    )


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``kvserve`` command's subparsers; it runs :func:`run_serve`."""
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI API over HTTP",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add_serve_arguments(parser)
    parser.set_defaults(run=run_serve)
    return parser


def register(subparsers: Any) -> None:
    """The ``kvserve serve`` subcommand (see ``kvserve/cli.py``)."""
    add_serve_parser(subparsers)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted; returns the exit code."""
    # Imported here so that `kvserve --help` stays fast.
    from kvserve.chat.render import install_chat_template
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.own_thread import build_on_own_thread
    from kvserve.entrypoints.openai.api_server import build_app
    from kvserve.entrypoints.openai.connection_limits import uvicorn_options
    from kvserve.entrypoints.openai.uvicorn_server import serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.ray:
        from kvserve.serve.ray.cli import run_ray_serve

        return run_ray_serve(args)
    with contextlib.ExitStack() as resources:
        try:
            config = server_config_from_args(args)
            engine_config = engine_config_from_args(args)
            template = read_chat_template(args.chat_template) if args.chat_template else None
            trace = resources.enter_context(open_trace(args.trace))
            # Off the main thread, so that only the engine loop keeps OpenMP workers.
            engine = build_on_own_thread(lambda: LLMEngine(engine_config))
            engine.set_trace(trace)
            embedding_engine = None
            if args.embedding_model:
                embedding_config = embedding_engine_config(engine_config, args.embedding_model)
                embedding_engine = build_on_own_thread(lambda: LLMEngine(embedding_config))
            if template is not None:
                # Without one, a model lacking its own template answers /v1/chat/completions
                # with 400.
                install_chat_template(engine.tokenizer, template)
            # The engine lives as long as the process: move what start-up built (the
            # tokenizer's vocabulary, the model's modules) out of the garbage collector's
            # sight, or every full collection between steps walks all of it again.
            gc.collect()
            gc.freeze()
        except InvalidParameterError as exc:
            sys.exit(f"kvserve serve: {exc}")
        if not config.api_keys and not _is_loopback(args.host):
            logger.warning(
                "serving on %s without an API key: anyone who can reach it may use it", args.host
            )
        # uvicorn returns once the app's shutdown has stopped the engine loop, so the
        # trace is closed after the last step it records.
        serve(
            build_app(engine, config, embedding_engine, args.embedding_model),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,  # kvserve.access logs one line per request, with token counts
            **uvicorn_options(config),
        )
    return 0


def embedding_engine_config(config: EngineConfig, model: str) -> EngineConfig:
    """The engine flags of ``--model`` for the ``--embedding-model``: its own model, task
    (``embed``), pooling and context length; the precision, threads and limits shared."""
    model_config = dataclasses.replace(
        config.model_config,
        model=model,
        task="embed",
        pooling_type="auto",
        max_model_len=None,
        revision=None,
        quantization="auto",  # vectors as trained: a generator's --quantization stays its own
    )
    return dataclasses.replace(config, model_config=model_config)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
