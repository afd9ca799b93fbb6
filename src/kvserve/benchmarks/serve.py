"""``kvserve bench serve``: streaming load on any OpenAI-compatible server.

Sends ``--num-requests`` streamed requests, at most ``--concurrency`` at a
time, to the server at ``--base-url`` (kvserve's ``kvserve serve``, llama.cpp's
llama-server, vLLM), each asking for ``--max-tokens`` tokens with
``ignore_eos``, and measures what a user of the server sees: wall time,
output tokens per second, requests per second, time to first token (TTFT),
inter-token latency (ITL: per request, the time from its first to its last
token over its tokens after the first) and the gaps between consecutive
streamed chunks, where a stall shows.

Prompts are seeded prose from the benchmark text generator: ``distinct``
prompts of about ``--prompt-tokens`` tokens, or ``shared-prefix``: one system
prompt of about ``--shared-prefix-tokens`` tokens shared by every request,
then a question of about ``--prompt-tokens`` tokens of its own. The client has
no tokenizer (the server may run any model), so lengths are approximate,
counted in words. Every repetition, and the warm-up, draws its own prompts
from the seed, so no server's prefix cache carries one repetition into the
next. Tokens are counted from the ``usage`` the server reports at the end of
each stream, or, from servers that send none, one per chunk of text.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.benchmarks.common import Table, write_json
from kvserve.benchmarks.serve_client import (
    Prompt,
    RunRecord,
    ServerError,
    Target,
    list_models,
    make_client,
    run_requests,
)
from kvserve.benchmarks.serve_metrics import ServeMetrics, median_of, summarize
from kvserve.benchmarks.text import random_words
from kvserve.errors import InvalidParameterError

PROMPT_KINDS = ("distinct", "shared-prefix")
# Tokens per word of the text generator's prose, measured with SmolLM2's
# tokenizer (2,755 tokens for 2,366 words); other vocabularies differ somewhat.
TOKENS_PER_WORD = 1.16


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="streaming load on an OpenAI-compatible server (kvserve, llama-server, vLLM)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", required=True, help="the API's root, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument(
        "--model", help="the model named in requests (default: the first of GET /models)"
    )
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    add_load_arguments(parser)


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


@dataclass(frozen=True)
class ServeReport:
    """Every repetition's figures, their medians, and the failures over all of them."""

    model: str
    median: ServeMetrics
    runs: list[ServeMetrics]
    num_failed: int
    first_error: str | None


def approx_words(num_tokens: int) -> int:
    """How many words of the generator's prose make about ``num_tokens`` tokens."""
    return max(1, round(num_tokens / TOKENS_PER_WORD))


def make_prompts(
    kind: str,
    num_requests: int,
    prompt_tokens: int,
    shared_prefix_tokens: int,
    seed: int,
    round_name: str,
    num_prefixes: int = 1,
) -> list[Prompt]:
    """The prompts of one round (``"warmup"``, ``"run-0"``, ...), reproducible from ``seed``.

    num_prefixes: shared-prefix only: system prompts to draw each request's from.
    """
    if kind not in PROMPT_KINDS:
        raise InvalidParameterError("prompt_kind", f"must be one of {PROMPT_KINDS}, got {kind!r}")
    # A string seed is hashed with SHA-512: the same prompts in every process.
    rng = random.Random(f"kvserve-bench-serve/{seed}/{round_name}")
    if kind == "distinct":
        systems: list[str | None] = [None]
    else:
        words = approx_words(shared_prefix_tokens)
        systems = [random_words(rng, words) for _ in range(num_prefixes)]
    prompts = []
    for _ in range(num_requests):
        # One prefix draws nothing: the prompts stay those of before --num-prefixes.
        system = systems[0] if len(systems) == 1 else systems[rng.randrange(len(systems))]
        prompts.append(Prompt(system, random_words(rng, approx_words(prompt_tokens))))
    return prompts


def check_args(args: argparse.Namespace) -> None:
    """Refuse values no run could use, before anything is sent."""
    if not args.base_url.startswith(("http://", "https://")):
        raise InvalidParameterError(
            "base_url", f"must start with http:// or https://, got {args.base_url!r}"
        )
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


async def benchmark(args: argparse.Namespace) -> ServeReport:
    """The warm-up, then the timed repetitions, against ``args.base_url``."""
    async with make_client(args.concurrency, args.timeout) as client:
        base_url = args.base_url.rstrip("/")
        model = args.model
        if model is None:
            models = await list_models(client, base_url, args.api_key)
            if not models:
                raise ServerError(f"GET {base_url}/models lists no model; pass --model")
            model = models[0]
        target = Target(base_url, model, args.endpoint, args.max_tokens, args.api_key)

        async def run_round(count: int, round_name: str) -> RunRecord:
            shape = (args.prompt_tokens, args.shared_prefix_tokens)
            prompts = make_prompts(
                args.prompt_kind, count, *shape, args.seed, round_name, args.num_prefixes
            )
            return await run_requests(
                client, target, prompts, args.concurrency, args.timeout, args.max_duration
            )

        # The warm-up's failures are not reported: the timed runs will meet the same ones.
        await run_round(args.warmup, "warmup")
        records = [await run_round(args.num_requests, f"run-{i}") for i in range(args.repetitions)]
    errors = [r.error for record in records for r in record.requests if r.error is not None]
    runs = [summarize(record) for record in records]
    return ServeReport(model, median_of(runs), runs, len(errors), errors[0] if errors else None)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; exit code 0 when every request succeeded, else 1."""
    check_args(args)
    try:
        report = asyncio.run(benchmark(args))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(args, report)
    if args.json:
        write_json(args.json, "serve", json_payload(args, report))
    return 0 if report.num_failed == 0 else 1


def json_payload(args: argparse.Namespace, report: ServeReport) -> dict[str, Any]:
    """The arguments (the API key withheld) and every figure."""
    arguments = {key: value for key, value in vars(args).items() if key != "run"}
    if arguments.get("api_key") is not None:
        arguments["api_key"] = "(set)"
    return {
        "args": arguments,
        "model": report.model,
        "expected_output_tokens": args.num_requests * args.max_tokens,
        "median": asdict(report.median),
        "runs": [asdict(run) for run in report.runs],
        "num_failed": report.num_failed,
        "first_error": report.first_error,
    }


def print_report(args: argparse.Namespace, report: ServeReport) -> None:
    median = report.median
    prompt = f"~{args.prompt_tokens}-token prompts"
    if args.prompt_kind == "shared-prefix":
        prompt = shared_prefix_description(args)
    print(
        f"{args.num_requests} requests, {args.concurrency} at a time, to {args.base_url} "
        f"({args.endpoint}, model {report.model}): {prompt}, {args.max_tokens} output tokens each; "
        f"median of {args.repetitions}"
    )
    table = Table(["ms", "p50", "p90", "p99", "max"])
    table.add("TTFT", median.ttft_p50_ms, median.ttft_p90_ms, median.ttft_p99_ms, "-")
    table.add("ITL", median.itl_p50_ms, median.itl_p90_ms, median.itl_p99_ms, "-")
    table.add("chunk gap", median.gap_p50_ms, "-", median.gap_p99_ms, median.gap_max_ms)
    print(table.render())
    by_usage, succeeded = median.num_counted_by_usage, median.num_succeeded
    if by_usage == succeeded:
        counted = "counted from the server's usage"
    elif by_usage == 0:
        counted = "counted one per chunk of text: the server sent no usage"
    else:
        counted = f"{by_usage} of {succeeded} requests counted from usage, the rest one per chunk"
    print(
        f"wall {median.wall_s:.2f} s, {median.output_tokens:,} output tokens ({counted}), "
        f"{median.output_tokens_per_s:,.1f} tok/s, {median.requests_per_s:.2f} req/s"
    )
    expected = succeeded * args.max_tokens
    if median.output_tokens != expected:
        why = (
            "the server stopped some requests early: does it honour ignore_eos?"
            if by_usage == succeeded
            else "without usage a chunk counts as one token, however many it carries"
        )
        print(f"note: {expected:,} output tokens expected ({args.max_tokens} a request); {why}")
    if report.num_failed:
        total = args.num_requests * args.repetitions
        print(f"{report.num_failed} of {total} requests failed; first error: {report.first_error}")


def shared_prefix_description(args: argparse.Namespace) -> str:
    """The shared-prefix prompts in words, for the report's first line."""
    prefix = f"~{args.shared_prefix_tokens}-token shared prefix"
    if args.num_prefixes > 1:
        prefix = f"one of {args.num_prefixes} {prefix}es"
    return f"{prefix} + ~{args.prompt_tokens}-token questions"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except InvalidParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
