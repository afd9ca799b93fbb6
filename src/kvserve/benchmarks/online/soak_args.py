"""``kvserve bench soak``'s flags, their checks, and the kinds of request they select."""

from __future__ import annotations

import argparse

from kvserve.benchmarks.online.serve_args import add_server_args, check_base_url
from kvserve.benchmarks.online.server_probe import read_rss_bytes
from kvserve.benchmarks.online.soak_hostile import HOSTILE_KINDS
from kvserve.benchmarks.online.soak_report import ALL_KINDS, MIB
from kvserve.benchmarks.online.soak_requests import KINDS, Kind
from kvserve.benchmarks.online.soak_template import TEMPLATE, TEMPLATE_KIND
from kvserve.errors import InvalidParameterError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add_server_args(parser)
    add("--server-pid", type=int, help="the server's process id, to sample its resident memory")
    add("--duration", type=float, default=1200.0, help="seconds of load (default %(default)g)")
    add(
        "--warmup",
        type=float,
        default=120.0,
        help="seconds before the memory baseline is taken (default %(default)g)",
    )
    add("--concurrency", type=int, default=8, help="clients at once (default %(default)s)")
    add(
        "--max-tokens", type=int, default=32, help="tokens per normal request (default %(default)s)"
    )
    add(
        "--long-max-tokens",
        type=int,
        default=256,
        help="tokens per preempting or abandoned request (default %(default)s)",
    )
    add("--preempt-n", type=int, default=4, help="n of preempting requests (default %(default)s)")
    add("--prompt-words", type=int, default=24, help="words per prompt (default %(default)s)")
    add(
        "--oversized-bytes",
        type=int,
        default=2 * MIB,
        help="size of the oversized bodies; must exceed the server's --max-request-body-bytes "
        "(default %(default)s)",
    )
    add(
        "--max-rss-growth-mib",
        type=float,
        default=256.0,
        help="the run fails if resident memory grows more than this after warm-up "
        "(default %(default)g)",
    )
    add("--rss-interval", type=float, default=2.0, help="seconds between memory samples")
    add("--drain-timeout", type=float, default=60.0, help="seconds to wait for the server to drain")
    add("--timeout", type=float, default=300.0, help="seconds one request may take")
    add(
        "--max-health-seconds",
        type=float,
        default=1.0,
        help="/health, asked every --rss-interval seconds, must answer within this "
        "(default %(default)g)",
    )
    add(
        "--kinds",
        nargs="+",
        choices=[kind.name for kind in ALL_KINDS],
        metavar="KIND",
        help="send only these kinds of request, in their usual proportions (default: "
        f"{', '.join(kind.name for kind in KINDS)}, and the kinds the two options below turn on)",
    )
    add(
        "--hostile",
        action="store_true",
        help="also send slow bodies (slow-body) and grammars that fail when used (grammar)",
    )
    add(
        "--slow-body-seconds",
        type=float,
        default=15.0,
        help="how long a slow-body client trickles or stalls before it gives up "
        "(default %(default)g)",
    )
    add(
        "--template-model",
        metavar="MODEL",
        help="start a second kvserve server on MODEL (a tiny one will do) with a hostile chat "
        "template, and send it chat requests (kind template)",
    )
    add(
        "--template-server-args",
        default="",
        help="more `kvserve serve` flags for that server, as one string (e.g. '--dtype float32')",
    )
    add(
        "--template-timeout",
        type=float,
        default=20.0,
        help="seconds a template request may take (default %(default)g)",
    )
    add(
        "--template-start-timeout",
        type=float,
        default=300.0,
        help="seconds the template server may take to start (default %(default)g)",
    )
    add(
        "--template-server-memory-mib",
        type=int,
        default=4096,
        help="the template server's data memory cap (default %(default)s)",
    )
    add("--seed", type=int, default=0, help="seeds the mix and the prompts (default %(default)s)")
    add("--json", metavar="PATH", help="also write the results as JSON")


def check_args(args: argparse.Namespace) -> None:
    """Refuse values no run could use, before anything is sent."""
    check_base_url(args.base_url)
    for name in ("concurrency", "max_tokens", "long_max_tokens", "preempt_n", "prompt_words"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(name, f"must be >= 1, got {getattr(args, name)}")
    for name in (
        "duration",
        "rss_interval",
        "timeout",
        "oversized_bytes",
        "max_health_seconds",
        "slow_body_seconds",
        "template_timeout",
        "template_start_timeout",
        "template_server_memory_mib",
    ):
        if not getattr(args, name) > 0:
            raise InvalidParameterError(name, f"must be > 0, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.duration:
        raise InvalidParameterError(
            "warmup", f"must be in [0, duration={args.duration:g}), got {args.warmup:g}"
        )
    if args.kinds is not None and TEMPLATE in args.kinds and not args.template_model:
        raise InvalidParameterError("kinds", "the template kind needs --template-model")
    if args.server_pid is not None and read_rss_bytes(args.server_pid) is None:
        raise InvalidParameterError(
            "server_pid", f"no process {args.server_pid} whose memory can be read (Linux /proc)"
        )


def selected_kinds(args: argparse.Namespace) -> list[Kind]:
    """The kinds this run sends: ``--kinds``, else the standard ones and those turned on."""
    if args.kinds is not None:
        return [kind for kind in ALL_KINDS if kind.name in args.kinds]
    kinds = list(KINDS)
    if args.hostile:
        kinds += HOSTILE_KINDS
    if args.template_model:
        kinds.append(TEMPLATE_KIND)
    return kinds
