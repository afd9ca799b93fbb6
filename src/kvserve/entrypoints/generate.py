"""``kvserve generate``: complete a batch of prompts and print the completions.

All prompts go to the engine at once, so they run with continuous batching.
A single completion is printed bare (handy in pipes); several are printed in
prompt order, each under a header.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvserve.entrypoints.args import (
    add_chat_template_arg,
    add_engine_args,
    add_sampling_args,
    engine_kwargs,
    read_chat_template,
    sampling_params,
    use_chat_template,
)
from kvserve.errors import InvalidParameterError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.trace.cli import add_trace_arg, open_trace

_HEADER_PROMPT_CHARS = 60


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="complete prompts and print the completions",
        usage="%(prog)s [options] [PROMPT ...]",
        description="Complete prompts with continuous batching and print each completion.",
    )
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to complete")
    parser.add_argument(
        "--prompt-file",
        type=Path,
        help="also read prompts from this file, one per line ('-' reads standard input)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message, rendered with the chat template",
    )
    add_chat_template_arg(parser)
    add_sampling_args(parser)
    # --seed is the sampling seed here; the engine's own seed keeps its default.
    add_engine_args(parser, exclude=("seed",))
    add_trace_arg(parser)
    parser.set_defaults(run=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The positional prompts, then the non-empty lines of --prompt-file."""
    prompts = list(args.prompts)
    if args.prompt_file is not None:
        if str(args.prompt_file) == "-":
            lines = sys.stdin.read().splitlines()
        else:
            try:
                lines = args.prompt_file.read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise InvalidParameterError("prompt_file", str(exc)) from exc
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise InvalidParameterError("prompt", "give at least one prompt or --prompt-file")
    return prompts


def run(args: argparse.Namespace) -> int:
    # Everything that can be checked without the model is checked first.
    prompts = read_prompts(args)
    params = sampling_params(args)
    if args.chat_template is not None and not args.chat:
        raise InvalidParameterError("chat_template", "only applies together with --chat")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    model, engine_args = engine_kwargs(args)
    with open_trace(args.trace) as trace:
        from kvserve.llm import LLM  # imports torch: only once the command line is known good

        llm = LLM(model, **engine_args)
        llm.llm_engine.set_trace(trace)
        use_tqdm = sys.stderr.isatty()
        if args.chat:
            use_chat_template(llm.get_tokenizer(), template, model)
            conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
            outputs = llm.chat(conversations, params, use_tqdm=use_tqdm)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    print_outputs(prompts, outputs)
    failed = [index for index, output in enumerate(outputs) if output.error is not None]
    for index in failed:
        print(f"error: prompt {index + 1} failed: {outputs[index].error}", file=sys.stderr)
    return 1 if failed else 0


def print_outputs(prompts: Sequence[str], outputs: Sequence[RequestOutput]) -> None:
    bare = len(outputs) == 1 and len(outputs[0].outputs) == 1
    for prompt_index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for completion in output.outputs:
            if not bare:
                print(_header(prompt_index, len(prompts), prompt, completion, len(output.outputs)))
            print(completion.text)
            if completion.logprobs is not None:
                _print_logprobs(completion)


def _header(index: int, num_prompts: int, prompt: str, completion: CompletionOutput, n: int) -> str:
    shown = prompt if len(prompt) <= _HEADER_PROMPT_CHARS else prompt[:_HEADER_PROMPT_CHARS] + "…"
    which = f"prompt {index + 1}/{num_prompts}"
    if n > 1:
        which += f", completion {completion.index + 1}/{n}"
    return f"=== {which}: {shown!r} ==="


def _print_logprobs(completion: CompletionOutput) -> None:
    """One line per generated token: its text, logprob, and the most likely alternatives."""
    for token_id, entries in zip(completion.token_ids, completion.logprobs or [], strict=True):
        sampled = entries[token_id]
        alternatives = ", ".join(
            f"{entry.decoded_token!r} {entry.logprob:.3f}"
            for entry_id, entry in entries.items()
            if entry_id != token_id
        )
        line = f"  {sampled.decoded_token!r:>16} {sampled.logprob:8.3f}  rank {sampled.rank}"
        print(line + (f"  | {alternatives}" if alternatives else ""))
