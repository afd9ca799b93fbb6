"""kvserve on the GPU against transformers on the same weights, on the same GPU.

For each model and dtype, kvserve runs one workload (``Scenario``) with
FlexAttention eagerly and with decode steps replayed as CUDA graphs (and, in
float32 where it fits, on the CPU): greedy, ``ignore_eos``, the top-20
logprobs of every generated token. The workload is sized to go through
chunked prefill (prompts longer than a step's token budget), preemption (a
pool about half as large as the work: asserted) and prefix-cache hits (two
requests that share a prompt's first blocks: asserted where the model caches
prefixes; Gemma 2's sliding layers turn that off).

transformers scores each request's prompt and kvserve's tokens in one
teacher-forced forward pass, so a token that differs costs one position,
not the rest of the run. Logprobs (logits less their row's log-sum-exp)
must agree within ``TOLERANCES`` on kvserve's top 20 tokens, and kvserve's
greedy token must be transformers' argmax wherever transformers' top-2 gap
exceeds that tolerance. In bfloat16 both drift from float32 math, so also:
kvserve's mean error against transformers in float32 must stay within
``BF16_ERROR_RATIO`` times transformers' own bfloat16 error (plus 0.02).
Against kvserve on the CPU in float32, tokens must agree up to the first
position where the CPU's top two are within the tolerance.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass
from typing import Any

from kvserve.benchmarks.gpu_check.compare import agreement, compare, drift, reference_logprobs
from kvserve.benchmarks.gpu_check.context import Context

TOLERANCES = {"bfloat16": 1.0, "float32": 5e-3}
BF16_ERROR_RATIO = 1.5
LOGPROBS = 20
# Which dtypes each model is checked in, and whether kvserve on the CPU (float32) is a
# second reference: Gemma 2 2B's float32 run on 16 cores would take most of a step's budget.
PLAN = {
    "smollm2-135m": (("bfloat16", "float32"), True),
    "qwen3-0.6b": (("bfloat16", "float32"), True),
    "gemma2-2b": (("bfloat16",), False),
}
# The dry run's: each code path once (bf16 and float32, the CPU reference), no more.
DRY_PLAN = {
    "smollm2-135m": (("bfloat16", "float32"), True),
    "qwen3-0.6b": (("float32",), False),
    "gemma2-2b": (("bfloat16",), False),
}
BUDGETS_S = {"smollm2-135m": 120.0, "qwen3-0.6b": 150.0, "gemma2-2b": 180.0}


@dataclass(frozen=True)
class Scenario:
    """prompt_lens, output_len: the first wave (preempted: the pool holds about
    ``pool_fraction`` of what it needs); prefix_len, suffix_len, output2: one request of
    a fresh prefix, then two more sharing it (prefix-cache hits)."""

    prompt_lens: tuple[int, ...] = (17, 40, 64, 100, 150, 200, 260, 300)
    output_len: int = 24
    prefix_len: int = 64
    suffix_len: int = 20
    output2: int = 8
    block_size: int = 16
    max_num_batched_tokens: int = 128
    max_num_seqs: int = 8
    max_model_len: int = 1024
    pool_fraction: float = 0.55


# The dry run's: the same three waves, shorter, in blocks of 4 tokens.
DRY_SCENARIO = Scenario(
    prompt_lens=(5, 9, 13, 17, 23, 30, 37, 45),
    output_len=6,
    prefix_len=16,
    suffix_len=6,
    output2=3,
    block_size=4,
    max_num_batched_tokens=32,
    max_model_len=256,
)


def variants(ctx: Context, dtype: str, cpu_reference: bool) -> dict[str, dict[str, Any]]:
    """Engine settings of each run. The dry run has no "graphs" run (on the CPU it would be
    the eager one again) and runs one thread (OpenMP's threads stall on a small, shared
    CPU); its "cpu" run is the eager one's twin, there to exercise the comparison."""
    if ctx.dry_run:
        runs = {"eager": dict(device="cpu", attention_backend="auto", num_threads=1)}
    else:
        runs = {
            "eager": dict(device="cuda", attention_backend="flex", enforce_eager=True),
            "graphs": dict(device="cuda", attention_backend="flex", enforce_eager=False),
        }
    if cpu_reference and dtype == "float32":
        runs["cpu"] = dict(runs["eager"], device="cpu", attention_backend="auto")
        runs["cpu"].pop("enforce_eager", None)
    return runs


def prompts(vocab: int, scenario: Scenario, seed: int = 0) -> list[list[list[int]]]:
    """The three waves' prompts: random token ids below ``vocab`` (the tokenizer's size)."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = draw(scenario.prefix_len)
    return [
        [draw(n) for n in scenario.prompt_lens],
        [prefix + draw(scenario.suffix_len)],
        [prefix + draw(scenario.suffix_len) for _ in range(2)],
    ]


def pool_blocks(folder: str, scenario: Scenario) -> int:
    """A pool (null block included) of ``pool_fraction`` of the first wave's blocks, and
    never less than its longest request needs."""
    from kvserve.core.kv_cache_groups import blocks_for_sequence, make_kv_cache_groups
    from kvserve.loader import load_arch_config, resolve_model

    arch = load_arch_config(resolve_model(folder))
    groups = make_kv_cache_groups(
        [arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)]
    )
    windows = [group.sliding_window for group in groups]
    needs = [
        blocks_for_sequence(
            windows, n + scenario.output_len, scenario.block_size, scenario.max_num_batched_tokens
        )
        for n in scenario.prompt_lens
    ]
    return max(max(needs) + 1, int(scenario.pool_fraction * sum(needs))) + 1


def run_kvserve(
    folder: str, dtype: str, settings: dict[str, Any], scenario: Scenario, waves: list[Any]
) -> dict[str, Any]:
    """One engine through the three waves: each request's tokens and logprobs, and what
    the engine did (preemptions, prefix-cache hits, graph buckets)."""
    import torch

    from kvserve import SamplingParams
    from kvserve.llm import LLM

    llm = LLM(
        folder,
        dtype=dtype,
        block_size=scenario.block_size,
        num_blocks=pool_blocks(folder, scenario),
        max_num_batched_tokens=scenario.max_num_batched_tokens,
        max_num_seqs=scenario.max_num_seqs,
        max_model_len=scenario.max_model_len,
        **settings,
    )
    engine = llm.llm_engine
    requests: list[dict[str, Any]] = []
    facts: dict[str, Any] = {}
    for index, (wave, output_len) in enumerate(
        zip(waves, (scenario.output_len, scenario.output2, scenario.output2), strict=True)
    ):
        hits = engine.kv_cache_manager.prefix_cache_hits
        params = SamplingParams(
            temperature=0, max_tokens=output_len, ignore_eos=True, logprobs=LOGPROBS
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
        for prompt, output in zip(wave, outputs, strict=True):
            completion = output.outputs[0]
            logprobs = [
                {t: lp.logprob for t, lp in row.items()} for row in completion.logprobs or []
            ]
            requests.append(
                {"prompt": prompt, "tokens": completion.token_ids, "logprobs": logprobs}
            )
        facts[f"wave{index + 1}_prefix_hit_tokens"] = (
            engine.kv_cache_manager.prefix_cache_hits - hits
        )
        if index == 0:
            facts["preemptions"] = engine.scheduler.num_preemptions_total
    graphs = engine.runner.decode_graphs
    facts |= {
        "prefix_caching": engine.kv_cache_manager.enable_caching,
        "graph_buckets": sorted(graphs.graphs) if graphs is not None else [],
        "precision": engine.runner.describe_precision(),
        "attention": type(engine.runner.attention_backend).__name__,
        "num_blocks": engine.runner.num_blocks,
    }
    del llm, engine, graphs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"requests": requests, "facts": facts}


def load_reference(folder: str, dtype: str, device: str) -> Any:
    """transformers' model of ``folder`` in ``dtype`` on ``device``, with its eager attention
    (the one that applies Gemma 2's soft cap)."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    return model.to(device).eval()


def check_model(ctx: Context, name: str) -> dict[str, Any]:
    """Every dtype and run of model ``name`` against transformers; problems: any miss."""
    from transformers import AutoTokenizer

    folder = ctx.model_path(name)
    dtypes, cpu_reference = (DRY_PLAN if ctx.dry_run else PLAN)[name]
    scenario = DRY_SCENARIO if ctx.dry_run else Scenario()
    waves = prompts(len(AutoTokenizer.from_pretrained(folder)), scenario)
    truth_model = load_reference(folder, "float32", ctx.device)
    result: dict[str, Any] = {"tolerances": TOLERANCES, "scenario": vars(scenario), "dtypes": {}}
    problems: list[str] = []
    for dtype in dtypes:
        tolerance = TOLERANCES[dtype]
        model = truth_model if dtype == "float32" else load_reference(folder, dtype, ctx.device)
        report: dict[str, Any] = {}
        runs: dict[str, dict[str, Any]] = {}
        for run_name, settings in variants(ctx, dtype, cpu_reference).items():
            label = f"{name} {dtype} {run_name}"
            run = runs[run_name] = run_kvserve(folder, dtype, settings, scenario, waves)
            refs = [reference_logprobs(model, r["prompt"], r["tokens"]) for r in run["requests"]]
            entry = compare(run, refs, tolerance) | run["facts"]
            if dtype != "float32":
                entry |= drift(run, refs, truth_model)
                ours, theirs = entry["mean_error_vs_float32"], entry["reference_error_vs_float32"]
                if ours > BF16_ERROR_RATIO * theirs + 0.02:
                    problems.append(
                        f"{label}: mean error vs float32 {ours:.3g} > {BF16_ERROR_RATIO} x "
                        f"transformers' {theirs:.3g} + 0.02"
                    )
            problems += run_problems(label, entry, tolerance, ctx.dry_run, run_name)
            report[run_name] = entry
        for run_name in [r for r in runs if r != "cpu"] if "cpu" in runs else []:
            match = report[f"{run_name}_vs_cpu"] = agreement(runs[run_name], runs["cpu"], tolerance)
            if match["diverged_decisively"] or match["max_error_before_divergence"] > tolerance:
                problems.append(f"{name} {dtype} {run_name} vs cpu: {match}")
        result["dtypes"][dtype] = report
        del model, runs
        gc.collect()
    print(result)
    return result | {"problems": problems}


def run_problems(
    label: str, entry: dict[str, Any], tolerance: float, dry_run: bool, run_name: str
) -> list[str]:
    """What one run got wrong: errors, tokens, and the paths it was meant to take."""
    problems = []
    if entry["max_error"] > tolerance:
        problems.append(f"{label}: logprob error {entry['max_error']:.3g} > {tolerance}")
    if entry["mismatched_tokens"]:
        problems.append(
            f"{label}: {entry['mismatched_tokens']} greedy tokens differ at clear positions"
        )
    if not entry["preemptions"]:
        problems.append(f"{label}: no preemption")
    if entry["prefix_caching"] and not entry["wave3_prefix_hit_tokens"]:
        problems.append(f"{label}: no prefix-cache hit")
    wants_graphs = run_name == "graphs" and not dry_run
    if wants_graphs != bool(entry["graph_buckets"]):
        problems.append(f"{label}: CUDA graph buckets {entry['graph_buckets']}")
    return problems
