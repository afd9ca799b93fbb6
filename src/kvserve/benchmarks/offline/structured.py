"""``kvserve bench structured``: what constrained decoding costs a batch, and grammar compiles.

Decode throughput of a batch where half the rows are constrained by a JSON
schema, beside the same batch unconstrained, at each ``--batch-sizes``
(default 16 and 64 concurrent sequences): the tokens per second of the
decode-only steps that ran the whole batch, medians of ``--repetitions``. The
schema (a long list of small records: numbers, strings, booleans, structure)
cannot be complete within ``--output-len`` tokens, so constrained rows run
exactly as long as the others (``ignore_eos``) and both batches do the same
work but for the masks.

Then grammar compile times for the twenty schemas of
:mod:`kvserve.benchmarks.workloads.structured_schemas` (median and max, on a fresh
compiler), and the cache hit rate when each is requested
``--schema-repeats`` times.

``--validity`` measures something else instead: how many of the twenty
schemas, as clients often write them (objects open: no
``additionalProperties``), give valid JSON within ``--max-tokens``, greedy and
sampled (temperature 1, a seed per schema). Each is sent as the server reads
an OpenAI ``response_format`` of type ``json_schema`` with ``strict``
(``--no-strict`` to send ``strict: false``); an answer counts when it ended by
itself (not cut off by ``--max-tokens``), parses and validates against the
schema sent (the ``jsonschema`` package, a dev dependency).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
from typing import Any

from kvserve.benchmarks.common import Table, median_metrics, ratio, write_json
from kvserve.benchmarks.offline.engine_driver import BenchRequest, drive
from kvserve.benchmarks.workloads.prompts import random_token_ids
from kvserve.benchmarks.workloads.structured_schemas import SCHEMAS, obj, open_schema
from kvserve.engine import LLMEngine
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams
from kvserve.structured import GrammarCompiler, StructuredOutputsParams

# Records never end before --output-len tokens: 64 of them take over 900 tokens.
RECORDS = {
    "type": "array",
    "minItems": 64,
    "items": obj(
        {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"},
        }
    ),
}


PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("structured", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--schema-repeats", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=3, help="timed runs per batch (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--validity",
        action="store_true",
        help="instead: how many of the twenty schemas (objects open) give valid JSON in time",
    )
    parser.add_argument("--max-tokens", type=int, default=160, help="with --validity")
    parser.add_argument(
        "--no-strict",
        dest="strict",
        action="store_false",
        help="with --validity: send the schemas with strict: false",
    )
    add_engine_args(parser)
    parser.set_defaults(run=run)


def batch(
    engine: LLMEngine, size: int, prompt_len: int, output_len: int, constrained: bool
) -> list[BenchRequest]:
    """``size`` requests; with ``constrained``, every other one is held to :data:`RECORDS`."""
    rng = random.Random(size)
    spec = StructuredOutputsParams(json=RECORDS)
    return [
        BenchRequest(
            random_token_ids(engine.tokenizer, prompt_len, rng),
            output_len,
            structured_outputs=spec if constrained and index % 2 else None,
        )
        for index in range(size)
    ]


def decode_rate(engine: LLMEngine, requests: list[BenchRequest]) -> dict[str, float]:
    result = drive(engine, requests)
    return {"decode_tok_per_s": result.decode_tok_per_s(len(requests))}


def compile_times(engine: LLMEngine, repeats: int) -> dict[str, float]:
    """Compile seconds of each schema on a fresh compiler, then the hit rate over repeats."""
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    specs = [StructuredOutputsParams(json=schema).spec for schema in SCHEMAS.values()]
    compiler.compile(StructuredOutputsParams(choice=["warm"]).spec).result()  # tokenizer build
    stats = compiler.stats
    hits, misses = stats.hits, stats.misses
    for _ in range(repeats):
        for spec in specs:
            compiler.compile(spec).result()
    seconds = stats.compile_seconds[1:]
    compiler.shutdown()
    hits, misses = stats.hits - hits, stats.misses - misses
    return {
        "compile_median_ms": 1000 * statistics.median(seconds),
        "compile_max_ms": 1000 * max(seconds),
        "cache_hit_rate": hits / (hits + misses),
    }


def response_format_constraint(name: str, schema: dict[str, Any], strict: bool) -> Any:
    """The constraint the server reads from ``response_format`` with this schema and ``strict``."""
    from types import SimpleNamespace

    from kvserve.entrypoints.openai.protocol import ResponseFormat
    from kvserve.entrypoints.openai.structured_request import structured_outputs

    json_schema = {"name": name.replace(" ", "_"), "schema": schema, "strict": strict}
    response_format = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": json_schema}
    )
    body = SimpleNamespace(response_format=response_format, structured_outputs=None)
    return structured_outputs(body)[0]


def validity(model: str, engine_args: dict[str, Any], max_tokens: int, strict: bool) -> Any:
    """Per schema, whether its greedy and its sampled answer are valid JSON, complete in time."""
    import jsonschema

    from kvserve.llm import LLM

    llm = LLM(model, **engine_args)
    conversations, params, cases = [], [], []
    for mode in ("greedy", "sampled"):
        for index, (name, closed) in enumerate(SCHEMAS.items()):
            schema = open_schema(closed)
            sampling: dict[str, Any] = {"temperature": 0.0 if mode == "greedy" else 1.0}
            if mode == "sampled":
                sampling["seed"] = index
            constraint = response_format_constraint(name, schema, strict)
            params.append(
                SamplingParams(**sampling, max_tokens=max_tokens, structured_outputs=constraint)
            )
            conversations.append(
                [{"role": "user", "content": f"Reply with a JSON example of a {name}."}]
            )
            cases.append((mode, name, schema))
    # A model without a chat template (a base model) gets the question as plain text.
    template = None if llm.get_tokenizer().chat_template else PLAIN_TEMPLATE
    outputs = llm.chat(conversations, params, use_tqdm=False, chat_template=template)
    results: dict[str, dict[str, Any]] = {"greedy": {}, "sampled": {}}
    for (mode, name, schema), output in zip(cases, outputs, strict=True):
        completion = output.outputs[0]
        valid = completion.finish_reason == "stop"
        try:
            jsonschema.validate(json.loads(completion.text), schema)
        except (ValueError, jsonschema.ValidationError):
            valid = False
        results[mode][name] = {"valid": valid, "text": completion.text}
    return results


def run_validity(args: argparse.Namespace) -> int:
    model, engine_args = engine_kwargs(args)
    results = validity(model, engine_args, args.max_tokens, args.strict)
    table = Table(["schema", "greedy", "sampled"])
    for name in SCHEMAS:
        table.add(name, *("valid" if results[m][name]["valid"] else "INVALID" for m in results))
    print(table.render())
    counts = {mode: sum(r["valid"] for r in results[mode].values()) for mode in results}
    print(
        f"valid JSON within {args.max_tokens} tokens (strict={str(args.strict).lower()}): "
        f"greedy {counts['greedy']}/{len(SCHEMAS)}, sampled {counts['sampled']}/{len(SCHEMAS)}"
    )
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key != "run"}
        write_json(args.json, "structured", {"args": settings, "valid": counts, **results})
    return 0


def run(args: argparse.Namespace) -> int:
    if args.validity:
        return run_validity(args)
    model, engine_args = engine_kwargs(args)
    engine_args.setdefault("max_num_seqs", max(args.batch_sizes))
    engine = LLMEngine.from_engine_args(model, **engine_args)
    table = Table(["batch", "unconstrained tok/s", "half JSON tok/s", "ratio"])
    results: dict[str, Any] = {"batches": {}}
    for size in args.batch_sizes:
        plain = batch(engine, size, args.prompt_len, args.output_len, constrained=False)
        mixed = batch(engine, size, args.prompt_len, args.output_len, constrained=True)
        # Compiled before timing (the engine caches it): the runs measure the masks only.
        engine.validator.check_grammar(
            SamplingParams(structured_outputs=mixed[1].structured_outputs)
        )
        warmup = functools.partial(drive, engine, batch(engine, size, 8, 4, constrained=True))
        medians = {}
        for name, requests in (("unconstrained", plain), ("mixed", mixed)):
            run_once = functools.partial(decode_rate, engine, requests)
            medians[name], _ = median_metrics(run_once, args.repetitions, warmup=warmup)
        plain_rate = medians["unconstrained"]["decode_tok_per_s"]
        mixed_rate = medians["mixed"]["decode_tok_per_s"]
        table.add(size, plain_rate, mixed_rate, ratio(mixed_rate, plain_rate))
        results["batches"][size] = {"unconstrained": plain_rate, "mixed": mixed_rate}
    print(table.render())
    compiles = compile_times(engine, args.schema_repeats)
    results["compile"] = compiles
    print(
        f"compile of {len(SCHEMAS)} schemas: median {compiles['compile_median_ms']:.2f} ms, "
        f"max {compiles['compile_max_ms']:.2f} ms; cache hit rate over "
        f"{args.schema_repeats} repeats {compiles['cache_hit_rate']:.0%}"
    )
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key != "run"}
        write_json(args.json, "structured", {"args": settings, **results})
    return 0
