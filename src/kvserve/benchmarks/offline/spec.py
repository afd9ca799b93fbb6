"""``kvserve bench spec``: speculative decoding against none, one stream, four workloads.

Greedy, batch 1 (what speculation is for: one stream leaves the CPU
memory-bound, so verifying several proposed tokens in one forward pass costs
little more than computing one). Each workload is one chat request shipped
with the bench (:mod:`kvserve.benchmarks.workloads.spec_texts`):

- ``code-edit``: a 56-line Python function, to be given back with one variable renamed;
- ``document-qa``: a report of about 1,000 tokens, and a question answered by quoting a section;
- ``json-extract``: a paragraph of facts, to be copied into JSON fields as exact strings;
- ``chat``: a short story, nothing to copy (the control: proposals rarely match).

For each workload, an engine without speculation and one per ``--methods``
entry: decode ms/token and output tok/s (after the first token, so the
prompt's prefill is left out), the acceptance rate (accepted over proposed
tokens, from the engine's counters) and the speed-up over no speculation;
medians of ``--repetitions``. The answer runs until the model ends it or
``--output-len`` tokens, whichever is first; greedy speculation is lossless,
so every method must produce the same tokens as none, and the table says
whether it did.

A ``--methods`` entry is ``METHOD[:FIELD=VALUE,...]``, the fields those of
``--speculative-config`` (``k`` is short for ``num_speculative_tokens``,
``min``/``max`` for ``prompt_lookup_min``/``prompt_lookup_max``), e.g.
``ngram:k=5,min=3``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

from kvserve.benchmarks.common import Table, cpu_info, ratio, write_json
from kvserve.benchmarks.workloads.spec_texts import (
    CHAT_REQUEST,
    CODE_EDIT_REQUEST,
    DOCUMENT_QUESTION,
    JSON_REQUEST,
)
from kvserve.chat.encode import encode_chat
from kvserve.config import SpeculativeConfig
from kvserve.engine import LLMEngine
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams
from kvserve.trace.cli import add_trace_arg, open_trace

WORKLOADS = {
    "code-edit": CODE_EDIT_REQUEST,
    "document-qa": DOCUMENT_QUESTION,
    "json-extract": JSON_REQUEST,
    "chat": CHAT_REQUEST,
}
DEFAULT_METHODS = ("ngram:k=3", "ngram:k=5")
NO_SPECULATION = "off"

# Short names for the fields a --methods entry sets most often.
_FIELD_ALIASES = {
    "k": "num_speculative_tokens",
    "min": "prompt_lookup_min",
    "max": "prompt_lookup_max",
}


@dataclass(frozen=True)
class MethodSpec:
    """One ``--methods`` entry: its text as given (the table's label) and its config."""

    label: str
    config: SpeculativeConfig


def _field_value(text: str) -> object:
    """``text`` as the JSON of ``--speculative-config`` would give it, else as written."""
    if text in ("true", "false"):
        return text == "true"
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def parse_method(text: str) -> MethodSpec:
    """``METHOD[:FIELD=VALUE,...]`` as a checked :class:`SpeculativeConfig`.

    Values that read as integers become integers, as numbers with a point floats, and
    ``true``/``false`` booleans; the config checks the rest, so a bad field or value
    fails here, before any model loads.
    """
    method, _, settings = text.partition(":")
    fields: dict[str, Any] = {"method": method.strip()}
    for item in filter(None, (part.strip() for part in settings.split(","))):
        name, equals, value = item.partition("=")
        if not equals or not name.strip() or not value.strip():
            raise InvalidParameterError(
                "methods", f"{text!r}: expected METHOD[:FIELD=VALUE,...], got {item!r}"
            )
        name = _FIELD_ALIASES.get(name.strip(), name.strip())
        value = value.strip()
        fields[name] = _field_value(value)
    try:
        config = SpeculativeConfig.from_value(fields)
    except InvalidParameterError as exc:
        raise InvalidParameterError("methods", f"{text!r}: {exc}") from None
    assert config is not None
    return MethodSpec(text, config)


def _method_arg(text: str) -> MethodSpec:
    try:
        return parse_method(text)
    except InvalidParameterError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("spec", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--methods",
        type=_method_arg,
        nargs="+",
        default=[parse_method(text) for text in DEFAULT_METHODS],
        metavar="METHOD[:FIELD=VALUE,...]",
        help=f"speculative settings to compare with none (default: {' '.join(DEFAULT_METHODS)})",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=tuple(WORKLOADS),
        default=list(WORKLOADS),
        help="workloads to run (default: all)",
    )
    parser.add_argument(
        "--output-len", type=int, default=256, help="most tokens per answer (default 256)"
    )
    parser.add_argument("--repetitions", type=int, default=3, help="timed runs per cell (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_trace_arg(parser)
    add_engine_args(parser, exclude=("speculative_config",))
    parser.set_defaults(run=run)


def prompt_token_ids(engine: LLMEngine, text: str) -> list[int]:
    """The request as the model's chat template frames it (plain text for a base model)."""
    tokenizer = engine.tokenizer
    if tokenizer.chat_template:
        return encode_chat(tokenizer, [{"role": "user", "content": text}], True, None)
    return list(tokenizer.encode(text))


@dataclass
class Answer:
    """One timed answer: its tokens, decode time, and the speculation counters' growth."""

    token_ids: list[int]
    decode_s: float
    proposed: int
    accepted: int


def answer(engine: LLMEngine, prompt: list[int], max_tokens: int) -> Answer:
    """Run one greedy request to its end, from a cold prefix cache (each repetition
    pays the same prefill, and proposals never come from a previous run's blocks) and a
    proposer that has forgotten earlier answers (suffix decoding would otherwise guess
    this answer from the last repetition's)."""
    engine.reset_prefix_cache()
    engine.forget_speculation_outputs()
    before = engine.stats
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engine.add_request("spec-bench", {"prompt_token_ids": prompt}, params)
    first_token_at: float | None = None
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids = list(output.outputs[0].token_ids)
            if first_token_at is None and token_ids:
                first_token_at = time.perf_counter()
    finished_at = time.perf_counter()
    after = engine.stats
    assert first_token_at is not None
    return Answer(
        token_ids,
        finished_at - first_token_at,
        after.num_spec_proposed_tokens - before.num_spec_proposed_tokens,
        after.num_spec_accepted_tokens - before.num_spec_accepted_tokens,
    )


@dataclass
class Cell:
    """One workload under one setting: medians over the repetitions.

    ms_per_token: decode time after the first token over the tokens after it.
    acceptance: accepted over proposed tokens, over all repetitions (None
        without speculation, or when nothing was proposed).
    """

    num_tokens: int
    ms_per_token: float
    tok_per_s: float
    proposed: int
    accepted: int
    token_ids: list[int]

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def measure(engine: LLMEngine, prompt: list[int], max_tokens: int, repetitions: int) -> Cell:
    answer(engine, prompt[:32], 8)  # warm-up: first-use compiles and allocations
    answers = [answer(engine, prompt, max_tokens) for _ in range(repetitions)]
    num_tokens = len(answers[0].token_ids)
    ms = statistics.median(1000 * a.decode_s / max(len(a.token_ids) - 1, 1) for a in answers)
    return Cell(
        num_tokens,
        ms,
        1000 / ms if ms else 0.0,
        sum(a.proposed for a in answers),
        sum(a.accepted for a in answers),
        answers[0].token_ids,
    )


def run(args: argparse.Namespace) -> int:
    if args.output_len < 2:
        raise InvalidParameterError("output-len", f"must be at least 2, got {args.output_len}")
    if args.repetitions < 1:
        raise InvalidParameterError("repetitions", f"must be at least 1, got {args.repetitions}")
    model, engine_args = engine_kwargs(args)
    settings: list[tuple[str, SpeculativeConfig | None]] = [(NO_SPECULATION, None)]
    settings += [(spec.label, spec.config) for spec in args.methods]
    print(cpu_info().describe())
    results: dict[str, dict[str, Cell]] = {name: {} for name in args.workloads}
    device = "cpu"
    with open_trace(args.trace) as trace:
        for label, config in settings:
            engine = LLMEngine.from_engine_args(model, **engine_args, speculative_config=config)
            engine.set_trace(trace)
            device = str(engine.runner.device)
            for workload in args.workloads:
                prompt = prompt_token_ids(engine, WORKLOADS[workload])
                results[workload][label] = measure(
                    engine, prompt, args.output_len, args.repetitions
                )
            engine.shutdown()
            del engine
            gc.collect()
    print(
        f"spec on {device}: greedy, batch 1, at most {args.output_len} output tokens, "
        f"median of {args.repetitions}"
    )
    print(spec_table(results).render())
    if args.json:
        payload = {
            "args": vars(args) | {"run": None, "methods": [m.label for m in args.methods]},
            "results": {
                workload: {
                    label: _cell_json(cell, cells.get(NO_SPECULATION))
                    for label, cell in cells.items()
                }
                for workload, cells in results.items()
            },
        }
        write_json(args.json, "spec", payload)
    return 0


def _cell_json(cell: Cell, reference: Cell | None) -> dict[str, Any]:
    return {
        "same_tokens_as_off": None if reference is None else cell.token_ids == reference.token_ids,
        "output_tokens": cell.num_tokens,
        "ms_per_token": cell.ms_per_token,
        "tok_per_s": cell.tok_per_s,
        "proposed": cell.proposed,
        "accepted": cell.accepted,
        "acceptance": cell.acceptance,
    }


def spec_table(results: dict[str, dict[str, Cell]]) -> Table:
    """A row per workload and setting; each method's row carries its speed-up over no
    speculation (its ms/token over the method's; above 1.00x speculation is faster) and
    whether it produced the same tokens (greedy speculation must)."""
    table = Table(
        ["workload", "method", "tokens", "ms/token", "tok/s", "acceptance", "speed-up", "same"]
    )
    for workload, cells in results.items():
        reference = cells.get(NO_SPECULATION)
        for label, cell in cells.items():
            is_reference = label == NO_SPECULATION
            acceptance = cell.acceptance
            table.add(
                workload,
                label,
                cell.num_tokens,
                cell.ms_per_token,
                cell.tok_per_s,
                "-" if acceptance is None else f"{acceptance:.0%}",
                "n/a" if reference is None else ratio(reference.ms_per_token, cell.ms_per_token),
                "-" if is_reference or reference is None else _yes_no(cell, reference),
            )
    return table


def _yes_no(cell: Cell, reference: Cell) -> str:
    return "yes" if cell.token_ids == reference.token_ids else "NO"
