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
import sys
from typing import Any

from kvserve.benchmarks.common import write_json
from kvserve.benchmarks.online.serve_args import add_arguments, check_args
from kvserve.benchmarks.online.serve_client import (
    RunRecord,
    ServerError,
    Target,
    list_models,
    make_client,
    run_requests,
)
from kvserve.benchmarks.online.serve_metrics import median_of, summarize
from kvserve.benchmarks.online.serve_report import ServeReport, json_payload, print_report
from kvserve.benchmarks.workloads.prompts import make_prompts
from kvserve.errors import InvalidParameterError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="streaming load on an OpenAI-compatible server (kvserve, llama-server, vLLM)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.online.serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except InvalidParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
