"""``kvserve bench serve``'s flags and their checks.

The server's address, model and key (``add_server_args``, ``check_base_url``,
``json_args``) are shared by every benchmark that loads a running server
(serve, soak, dashboard); the load's flags by ``bench routing``.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.benchmarks.workloads.prompts import PROMPT_KINDS
from kvserve.errors import InvalidParameterError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's address, the model and API key to send, then the load's flags."""
    add_server_args(parser)
    add_load_arguments(parser)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """``--base-url``, ``--model`` and ``--api-key``: the server a benchmark loads."""
    parser.add_argument(
        "--base-url", required=True, help="the API's root, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument(
        "--model", help="the model named in requests (default: the first of GET /models)"
    )
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")


def check_base_url(base_url: str) -> None:
    """Refuse an address that is not an http(s) URL, before anything is sent."""
    if not base_url.startswith(("http://", "https://")):
        raise InvalidParameterError(
            "base_url", f"must start with http:// or https://, got {base_url!r}"
        )


def json_args(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as a results file records them: the API key withheld."""
    arguments = {key: value for key, value in vars(args).items() if key != "run"}
    if arguments.get("api_key") is not None:
        arguments["api_key"] = "(set)"
    return arguments


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that shape the load (all but the server's address, model and key)."""
    parser.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/chat/completions or /completions (default %(default)s)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=128, help="requests timed (default %(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="requests in flight at most (default %(default)s)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="tokens generated each (default %(default)s)"
    )
    parser.add_argument(
        "--prompt-kind",
        choices=PROMPT_KINDS,
        default="distinct",
        help="each request its own prompt, or a shared system prompt and a question each "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=100,
        help="about this many tokens of each request's own text (default %(default)s)",
    )
    parser.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=400,
        help="about this many tokens of shared system prompt, for shared-prefix "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--num-prefixes",
        type=int,
        default=1,
        help="shared-prefix: this many system prompts, each request drawing one at random "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the prompt text (default %(default)s)"
    )
    parser.add_argument(
        "--repetitions",
        type=int,
        default=1,
        help="timed runs; figures are medians (default %(default)s)",
    )
    parser.add_argument(
        "--warmup", type=int, default=4, help="requests sent before timing (default %(default)s)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds one request may take (default %(default)g)",
    )
    parser.add_argument(
        "--max-duration",
        type=float,
        default=3600.0,
        help="seconds one repetition may take; requests still going then count as failed "
        "(default %(default)g)",
    )


def check_args(args: argparse.Namespace) -> None:
    """Refuse values no run could use, before anything is sent."""
    check_base_url(args.base_url)
    for name in (
        "num_requests",
        "concurrency",
        "max_tokens",
        "prompt_tokens",
        "repetitions",
        "num_prefixes",
    ):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"must be >= 1, got {getattr(args, name)}")
    if args.prompt_kind == "shared-prefix" and args.shared_prefix_tokens < 1:
        raise InvalidParameterError(
            "shared_prefix_tokens", f"must be >= 1, got {args.shared_prefix_tokens}"
        )
    if args.warmup < 0:
        raise InvalidParameterError("warmup", f"must be >= 0, got {args.warmup}")
    for name in ("timeout", "max_duration"):
        if not getattr(args, name) > 0:
            raise InvalidParameterError(name, f"must be > 0 seconds, got {getattr(args, name)}")
