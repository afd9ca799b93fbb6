"""``make demo``: SmolLM2-135M-Instruct answers 16 questions in one continuous batch.

All conversations are submitted at once through :meth:`LLM.chat`; the engine
mixes their prefill chunks and decodes in shared forward passes. Sampling is
seeded, and a seeded request's tokens do not depend on what else is in the
batch, so every run prints the same answers.

    python -m kvserve.demo [--model M] [--max-tokens N] [--dtype D]
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from collections.abc import Sequence

from kvserve.config import ModelConfig
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Write a Python function that returns the factorial of n.",
    "What is 17 + 25?",
    "List three primary colors.",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Give me one tip for sleeping better.",
    "What is photosynthesis? Answer in one sentence.",
    "Who wrote 'Romeo and Juliet'?",
    "Why is the sky blue?",
    "Suggest a name for a friendly orange cat.",
    "How many days are there in a leap year?",
    "Explain what a CPU does, briefly.",
    "What is the boiling point of water in Celsius?",
    "Give me a healthy breakfast idea.",
    "What does the word 'ephemeral' mean?",
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvserve.demo", description=__doc__)
    parser.add_argument("--model", default=ModelConfig.model, help="model path or alias")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed of every request")
    return parser.parse_args(argv)


def show_answer(number: int, question: str, answer: str) -> None:
    print(f"\n[{number:2d}] Q: {question}")
    lines = answer.strip().splitlines() or [""]
    # Keep the answer's own line breaks (code, lists); wrap only long lines.
    wrapped = [w for line in lines for w in (textwrap.wrap(line, 96) or [""])]
    print("\n".join("     " + ("A: " if i == 0 else "   ") + w for i, w in enumerate(wrapped)))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(
            temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens
        )
    except InvalidParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from kvserve.llm import LLM  # imports torch

    print(f"Loading {args.model} ...", flush=True)
    load_start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    load_seconds = time.perf_counter() - load_start
    engine = llm.llm_engine

    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    wall_seconds = time.perf_counter() - start

    for number, (question, output) in enumerate(zip(QUESTIONS, outputs, strict=True), start=1):
        show_answer(number, question, output.outputs[0].text)

    num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    num_output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    kv = engine.kv_cache_manager
    scheduler_config = engine.config.scheduler_config
    rows = [
        ("model", f"{args.model} ({engine.runner.describe_precision()})"),
        ("model load", f"{load_seconds:.1f} s, weights {engine.runner.weights_origin.value}"),
        ("requests", f"{len(outputs)}"),
        ("prompt tokens", f"{num_prompt_tokens}"),
        ("generated tokens", f"{num_output_tokens}"),
        ("wall time", f"{wall_seconds:.1f} s"),
        ("output throughput", f"{num_output_tokens / wall_seconds:.1f} tok/s"),
        (
            "peak KV blocks used",
            f"{engine.peak_num_blocks_used} of {kv.num_usable_blocks} "
            f"({kv.block_size} tokens each)",
        ),
        ("preemptions", f"{engine.scheduler.num_preemptions_total}"),
        (
            "batching",
            f"continuous, chunked prefill {'on' if scheduler_config.enable_chunked_prefill else 'off'}, "
            f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens}",
        ),
    ]
    print("\nSummary")
    for name, value in rows:
        print(f"  {name:<20} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
