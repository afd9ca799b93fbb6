"""``kvserve bench perplexity``: kvserve's perplexity on a fixed passage, beside llama.cpp's.

Both systems score the same text (``workloads/passage.txt``) the same way, the
way ``llama-perplexity`` does, so that their numbers can be set side by side:
the passage is tokenized once and cut into consecutive windows of ``--n-ctx``
tokens (a tail too short for a window is left out); when the tokenizer starts
a text with BOS, each window starts with BOS in place of its first token;
each window is one prompt, and only the second half of its tokens is scored,
so that every scored token sees at least ``n_ctx / 2`` tokens before it.
Perplexity is ``exp`` of the mean negative log-likelihood of the scored tokens.

kvserve's logprobs come from ``SamplingParams.prompt_logprobs``; llama.cpp's
``llama-perplexity`` runs on the model's GGUF as stored (or a BF16 copy with
``--llamacpp-weights bf16``), from the build the other llama.cpp baselines use.
The two tokenizers may split the text slightly differently, so the token
counts are printed too. A ratio near 1.00 says the two compute the same model.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvserve.benchmarks.baselines.llamacpp_baseline import add_llamacpp_args
from kvserve.benchmarks.baselines.llamacpp_tools import ToolRun, prepare_tool_run
from kvserve.benchmarks.common import write_json
from kvserve.benchmarks.workloads.passage import passage_path, passage_text
from kvserve.entrypoints.args import add_engine_args, engine_kwargs
from kvserve.errors import InvalidParameterError
from kvserve.llm import LLM
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import physical_core_count

LLAMA_PERPLEXITY = "llama-perplexity"
_FINAL_ESTIMATE = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("perplexity", help=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--n-ctx", type=int, default=512, help="tokens per window, as llama-perplexity's -c"
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=None,
        help="score only the first this many windows (default: every whole window)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--no-baselines", action="store_true", help="kvserve only (no llama-perplexity run)"
    )
    add_llamacpp_args(parser)
    add_engine_args(parser)
    parser.set_defaults(run=run)


class Perplexity(NamedTuple):
    """A perplexity and what it was measured over."""

    value: float
    num_windows: int
    num_scored: int  # tokens whose logprob entered the mean (llama.cpp: None)


def text_windows(
    token_ids: Sequence[int], n_ctx: int, max_windows: int | None, bos_token_id: int | None
) -> list[list[int]]:
    """Consecutive windows of ``n_ctx`` tokens, each led by ``bos_token_id`` if given."""
    if n_ctx < 4:
        raise InvalidParameterError("n_ctx", f"must be at least 4, got {n_ctx}")
    num_windows = len(token_ids) // n_ctx
    if max_windows is not None:
        if max_windows < 1:
            raise InvalidParameterError("windows", f"must be at least 1, got {max_windows}")
        num_windows = min(num_windows, max_windows)
    if num_windows == 0:
        raise InvalidParameterError(
            "n_ctx", f"the passage has {len(token_ids)} tokens, fewer than one window of {n_ctx}"
        )
    windows = [list(token_ids[i * n_ctx : (i + 1) * n_ctx]) for i in range(num_windows)]
    if bos_token_id is not None:
        for window in windows:
            window[0] = bos_token_id
    return windows


def scored_logprobs(output: RequestOutput, score_from: int) -> list[float]:
    """The logprobs of prompt tokens ``score_from`` on (``score_from >= 1``) of one window."""
    entries = output.prompt_logprobs
    if entries is None:
        raise ValueError(f"request {output.request_id} returned no prompt logprobs")
    values = []
    for position in range(score_from, len(output.prompt_token_ids)):
        entry = entries[position]
        assert entry is not None
        values.append(entry[output.prompt_token_ids[position]].logprob)
    return values


def kvserve_perplexity(llm: LLM, windows: list[list[int]], score_from: int) -> Perplexity:
    """Perplexity of ``windows`` scored from token ``score_from`` of each, by prompt logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts: list[Any] = [{"prompt_token_ids": window} for window in windows]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    logprobs = [value for output in outputs for value in scored_logprobs(output, score_from)]
    return Perplexity(math.exp(-math.fsum(logprobs) / len(logprobs)), len(windows), len(logprobs))


def llamacpp_perplexity(tools: ToolRun, n_ctx: int, num_windows: int, threads: int) -> Perplexity:
    """``llama-perplexity`` on the passage file: its final estimate over ``num_windows`` chunks."""
    tool = tools.build.tool(LLAMA_PERPLEXITY)
    if not tool.exists():
        raise InvalidParameterError(
            "baselines", f"{tool} is missing; rebuild llama.cpp's tools with `make bench-deps`"
        )
    command = [
        str(tool),
        "-m", str(tools.model_file),
        "-f", str(passage_path()),
        "-c", str(n_ctx),
        "--chunks", str(num_windows),
        "-t", str(threads),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    log = result.stdout + result.stderr
    match = _FINAL_ESTIMATE.search(log)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"{LLAMA_PERPLEXITY} failed ({result.returncode}): {log[-2000:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    return Perplexity(float(match.group(1)), int(chunks.group(1)) if chunks else num_windows, 0)


def run(args: argparse.Namespace) -> None:
    model, engine_args = engine_kwargs(args)
    # The baseline's file and build are checked before anything is measured.
    tools = None if args.no_baselines else prepare_tool_run(model, args.llamacpp_weights)
    if engine_args.get("max_model_len") is None:
        engine_args["max_model_len"] = args.n_ctx + 1  # each window samples one token
    llm = LLM(model, **engine_args)
    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer.encode(passage_text())
    bos = tokenizer.bos_token_id
    leads_with_bos = bos is not None and bool(token_ids) and token_ids[0] == bos
    windows = text_windows(token_ids, args.n_ctx, args.windows, bos if leads_with_bos else None)
    score_from = args.n_ctx // 2 + 1  # llama.cpp scores the tokens after position n_ctx / 2
    ours = kvserve_perplexity(llm, windows, score_from)
    precision = llm.llm_engine.runner.describe_precision()
    print(f"passage: {len(token_ids)} tokens (kvserve's tokenizer), windows of {args.n_ctx}")
    print(
        f"kvserve ({precision}): PPL {ours.value:.4f} over {ours.num_windows} windows, "
        f"{ours.num_scored} tokens scored"
    )
    results: dict[str, Any] = {
        "n_ctx": args.n_ctx,
        "passage_tokens": len(token_ids),
        "kvserve": {"ppl": ours.value, "windows": ours.num_windows, "scored": ours.num_scored},
    }
    if tools is not None:
        print(tools.describe(LLAMA_PERPLEXITY))
        theirs = llamacpp_perplexity(tools, args.n_ctx, len(windows), physical_core_count())
        print(f"llama.cpp: PPL {theirs.value:.4f} over {theirs.num_windows} windows")
        print(f"kvserve / llama.cpp: {ours.value / theirs.value:.4f}")
        results["llamacpp"] = {
            "ppl": theirs.value,
            "windows": theirs.num_windows,
            **tools.as_json(),
        }
        results["ratio"] = ours.value / theirs.value
    if args.json:
        write_json(args.json, "perplexity", results)
