"""Fuzz kvserve's HTTP API with schemathesis, from the server's own OpenAPI document.

schemathesis reads ``/openapi.json`` (behind the key when there is one) and
generates requests for every route in it: valid ones (by the document) and
invalid ones (wrong types, missing fields, unknown fields, broken headers).
Each answer must pass :mod:`fuzz.api_checks` (no 5xx, OpenAI's error shape,
401 without the key, well-formed streams) and schemathesis's checks against
the document (documented status codes, content types and bodies; invalid
requests refused). With a key, every fourth case is sent again with a wrong
or missing key. A few requests outside the document (its own pages, unknown
paths, wrong methods) are sent before and after. At the end the server must
still be healthy and hold no request and no KV block.

Without ``--base-url`` it starts ``kvserve serve`` on a tiny random model
twice, without a key and with one, and splits the cases between them; a
server that dies is a crash, reported and started again.

    PYTHONPATH=tests python -m fuzz.api_fuzz --cases 5000          # make fuzz
    PYTHONPATH=tests python -m fuzz.api_fuzz --base-url http://127.0.0.1:8000 --api-key KEY
"""

from __future__ import annotations

import argparse
import random
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fuzz.api_fuzz_summary import FuzzSummary
from fuzz.api_sender import Sender, ServerUnderTest, is_healthy
from fuzz.api_tame import tame_body

# hypothesis may generate fewer than max_examples (it stops early on a small input space);
# more rounds, each with a seed of its own, make up the difference.
MAX_ROUNDS = 8
TAMED_SHARE = 0.5  # of the valid cases (see api_tame)


def fuzz_server(server: ServerUnderTest, num_cases: int, seed: int, summary: FuzzSummary) -> None:
    """Send about ``num_cases`` generated cases to ``server``, adding what happened to ``summary``."""
    import schemathesis
    from schemathesis import GenerationMode

    sender = Sender(server, summary)
    headers = {} if server.api_key is None else {"Authorization": f"Bearer {server.api_key}"}
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    sender.probe_outside_schema()
    # Routes without a body have little to vary: a share each, the bodies get the rest.
    plain = [op for op in operations if not op.body]
    per_plain = max(2, num_cases // 40)
    pairs = [(op, mode) for op in plain for mode in GenerationMode]
    pairs += [(op, mode) for op in operations if op.body for mode in GenerationMode]
    for index, (operation, mode) in enumerate(pairs):
        remaining = num_cases - (summary.cases - sender.first_case)
        share = per_plain if not operation.body else remaining // (len(pairs) - index)
        _generate(sender, operation, mode, min(share, remaining), seed + index * MAX_ROUNDS)
    sender.probe_outside_schema()
    sender.check_after_run()


def _generate(sender: Sender, operation: object, mode: object, num_cases: int, seed: int) -> None:
    """Up to ``num_cases`` cases of ``operation`` in ``mode``, each sent by ``sender``."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    cases = operation.as_strategy(generation_mode=mode)  # type: ignore[attr-defined]
    tame = mode == GenerationMode.POSITIVE
    done = 0
    for round_index in range(MAX_ROUNDS):
        if done >= num_cases or sender.gave_up:
            return
        before = sender.summary.cases

        @hypothesis.seed(seed + round_index)
        @settings(
            max_examples=num_cases - done,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases, rng=st.randoms(use_true_random=False))
        def send_one(case: Any, rng: random.Random) -> None:
            if tame and rng.random() < TAMED_SHARE:
                case.body = tame_body(case.path, case.body, rng)
            sender.send_case(case)

        try:
            send_one()
        except Unsatisfiable:  # nothing to generate (an invalid request of a route with no input)
            return
        if sender.summary.cases == before:
            return
        done += sender.summary.cases - before


def run_on_tiny_servers(num_cases: int, seed: int, work_dir: Path) -> FuzzSummary:
    """Fuzz ``kvserve serve`` on a tiny model: half the cases without a key, half with one."""
    from fuzz.api_fuzz_server import ServerProcess, write_tiny_model

    summary = FuzzSummary(seed)
    start = time.perf_counter()
    model_dir = write_tiny_model(work_dir / "tiny-model")
    key = f"fuzz-{secrets.token_hex(16)}"
    for setup, keys in (("no key", ()), ("api key", (key,))):
        process = ServerProcess(model_dir, keys, work_dir / f"server-{setup.replace(' ', '-')}.log")
        process.start()

        def restart(process: ServerProcess = process) -> str:
            process.stop()
            return process.start().url

        server = ServerUnderTest(setup, process.url, keys[0] if keys else None, process.is_healthy)
        server.restart = restart
        try:
            fuzz_server(server, num_cases // 2, seed, summary)
        finally:
            if summary.crashes:
                print(f"server log ({setup}):\n{process.log_tail()}", file=sys.stderr)
            process.stop()
    summary.wall_s = time.perf_counter() - start
    return summary


def run_on_server(url: str, api_key: str | None, num_cases: int, seed: int) -> FuzzSummary:
    """Fuzz a server someone else started (it cannot be restarted from here)."""
    summary = FuzzSummary(seed)
    start = time.perf_counter()
    url = url.rstrip("/")
    setup = "api key" if api_key else "no key"
    server = ServerUnderTest(setup, url, api_key, lambda: is_healthy(url))
    fuzz_server(server, num_cases, seed, summary)
    summary.wall_s = time.perf_counter() - start
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.api_fuzz", description=__doc__)
    parser.add_argument("--cases", type=int, default=5000, help="generated cases in all")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds hypothesis (same seed, same cases)"
    )
    parser.add_argument("--base-url", help="fuzz this running server instead of starting tiny ones")
    parser.add_argument("--api-key", help="the key of --base-url's server, if it has one")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    args = parser.parse_args(argv)
    # On SIGTERM (a CI timeout), unwind so that the servers this started are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.base_url:
        summary = run_on_server(args.base_url, args.api_key, args.cases, args.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="kvserve-api-fuzz-") as work_dir:
            summary = run_on_tiny_servers(args.cases, args.seed, Path(work_dir))
    print(summary.format())
    if args.json:
        summary.write_json(args.json)
    return 0 if summary.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
