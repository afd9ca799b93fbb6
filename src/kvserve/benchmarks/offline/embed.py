"""``kvserve bench embed``: sentences per second of an embedding model, against the usual tools.

N sentences of 10 to 60 words (seeded prose, no downloads) are embedded by
kvserve (``LLM.embed``: the engine batches them by its token budget), by
sentence-transformers on the same model folder and the same number of
threads (``encode``, batches of ``--batch-size``), and by llama-server
``--embeddings`` on a GGUF of the same weights that the ``gguf`` package
writes (float32, as the folder stores them), sent in requests of
``--batch-size`` inputs. Each baseline's vectors are compared with
kvserve's (the lowest cosine similarity is printed), so a fast wrong
baseline cannot pass unnoticed. A baseline that is not installed is
reported as such and skipped.

``--mixed`` measures something else: chat output tokens per second of a
kvserve server under 16 chat streams, alone and beside an embedding stream
(``online/embed_mixed.py``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import time
from typing import Any

import numpy as np

from kvserve.benchmarks.common import (
    Metrics,
    Table,
    add_baselines_arg,
    add_common_args,
    cpu_info,
    median_metrics,
    ratio,
    selected_baselines,
    write_json,
)
from kvserve.benchmarks.workloads.sentences import embedding_sentences
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.llm import LLM
from kvserve.trace.cli import open_trace

SENTENCE_TRANSFORMERS = "sentence-transformers"
LLAMA_SERVER = "llama-server"
DEFAULT_MODEL = "all-minilm-l6-v2"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("embed", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--min-words", type=int, default=10)
    parser.add_argument("--max-words", type=int, default=60)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="sentences per batch of the baselines"
    )
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="instead: chat tok/s of a server with --chat-model and the embedding model, "
        "16 chat streams alone and beside an embedding stream",
    )
    parser.add_argument("--chat-model", default="smollm2-135m-instruct")
    parser.add_argument("--chat-streams", type=int, default=16)
    parser.add_argument("--embed-rate", type=float, default=50.0, help="sentences/s (--mixed)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase (--mixed)")
    add_baselines_arg(
        parser,
        choices=(SENTENCE_TRANSFORMERS, LLAMA_SERVER),
        default=(SENTENCE_TRANSFORMERS, LLAMA_SERVER),
    )
    add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(run=run, model=DEFAULT_MODEL)


def run(args: argparse.Namespace) -> int:
    if args.mixed:
        from kvserve.benchmarks.online.embed_mixed import run_mixed

        return run_mixed(args)
    print(cpu_info().describe())
    sentences = embedding_sentences(args.num_sentences, args.min_words, args.max_words, args.seed)
    model, engine_args = engine_kwargs(args)
    results: dict[str, Metrics] = {}
    with open_trace(args.trace) as trace:
        llm = LLM(model, **engine_args)
        engine = llm.llm_engine
        engine.set_trace(trace)
        threads = engine.runner.num_threads
        source = engine.source
        pooling = engine.limits.pooling
        if pooling is None:
            raise SystemExit(f"kvserve bench embed: {model} does not embed (try --task embed)")
        print(
            f"kvserve: {model}, {engine.runner.describe_precision()}, {threads} threads, "
            f"{pooling.pooling_type} pooling"
        )
        num_tokens = sum(len(engine.tokenizer(s)["input_ids"]) for s in sentences)
        print(
            f"workload: {len(sentences)} sentences of {args.min_words}-{args.max_words} words, "
            f"{num_tokens} tokens (seed {args.seed})"
        )
        warmup = functools.partial(llm.embed, sentences[:32], use_tqdm=False)
        results["kvserve"], _ = median_metrics(
            functools.partial(
                _timed, functools.partial(llm.embed, sentences, use_tqdm=False), len(sentences)
            ),
            args.repetitions,
            warmup=warmup,
        )
        ours = np.array([o.outputs.embedding for o in llm.embed(sentences[:64], use_tqdm=False)])
        del llm, engine
        gc.collect()
    baselines = selected_baselines(args)
    notes: dict[str, str] = {}
    if SENTENCE_TRANSFORMERS in baselines:
        if importlib.util.find_spec("sentence_transformers") is None:
            notes[SENTENCE_TRANSFORMERS] = (
                "not installed (pip install sentence-transformers, or make bench-deps)"
            )
        elif source.kind != "hf":
            notes[SENTENCE_TRANSFORMERS] = "needs a Hugging Face folder, not a GGUF file"
        else:
            from kvserve.benchmarks.baselines.embed_baselines import measure_sentence_transformers

            print(f"{SENTENCE_TRANSFORMERS}: float32, {threads} threads, batch {args.batch_size}")
            metrics, theirs = measure_sentence_transformers(
                str(source.path), sentences, threads, args.batch_size, args.repetitions
            )
            results[SENTENCE_TRANSFORMERS] = metrics | {"min_cosine": _min_cosine(ours, theirs)}
    if LLAMA_SERVER in baselines:
        from kvserve.benchmarks.baselines.embed_baselines import measure_llama_server

        try:
            metrics, theirs = measure_llama_server(
                source, pooling.pooling_type, sentences, threads, args.batch_size, args.repetitions
            )
            results[LLAMA_SERVER] = metrics | {"min_cosine": _min_cosine(ours, theirs)}
        except Exception as exc:  # no tool build, an architecture the GGUF writer lacks
            notes[LLAMA_SERVER] = f"not measured: {exc}"
    print(f"embeddings: {len(sentences)} sentences, median of {args.repetitions}")
    print(embed_table(results).render())
    for name, note in notes.items():
        print(f"{name}: {note}")
    if args.json:
        payload = {"args": vars(args) | {"run": None}, "results": results, "notes": notes}
        write_json(args.json, "embed", payload)
    return 0


def _timed(embed: Any, num_sentences: int) -> Metrics:
    started = time.perf_counter()
    embed()
    elapsed = time.perf_counter() - started
    return {"sentences_per_s": num_sentences / elapsed, "seconds": elapsed}


def _min_cosine(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The lowest cosine similarity between kvserve's vectors and a baseline's, row by row."""
    count = min(len(ours), len(theirs))
    a, b = ours[:count], np.asarray(theirs[:count], dtype=np.float64)
    dots = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(dots.min())


def embed_table(results: dict[str, Metrics]) -> Table:
    """One row per system; kvserve's says how many times faster it is than each baseline."""
    table = Table(["system", "sentences/s", "seconds", "kvserve speed-up", "min cosine vs kvserve"])
    ours = results["kvserve"]["sentences_per_s"]
    speedups = ", ".join(
        f"{ratio(ours, metrics['sentences_per_s'])} vs {name}"
        for name, metrics in results.items()
        if name != "kvserve"
    )
    table.add("kvserve", ours, results["kvserve"]["seconds"], speedups or "-", "-")
    for name, metrics in results.items():
        if name != "kvserve":
            cosine = f"{metrics['min_cosine']:.5f}"
            table.add(name, metrics["sentences_per_s"], metrics["seconds"], "-", cosine)
    return table
