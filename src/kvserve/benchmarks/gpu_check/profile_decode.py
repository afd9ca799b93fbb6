"""Where a decode step's time goes on the device: the kernels of a few profiled steps.

The sweep gives a decode step's wall time, its floor and the host's share; this
step says what the rest is made of. The engine runs ``n`` greedy requests
(prompts of 128-512 tokens, as the sweep's, with ``n`` more queued behind them)
until every one is decoding, then
PyTorch's profiler records a few decode-only steps: each kernel's device time
per step, the launches per step, and the host's own top operations. A CUDA
graph's replay shows as its kernels, so the table is the same with or without
graphs. Each batch size runs with KV blocks of 16 tokens (the default) and, at
the largest, of 64 too: FlexAttention's tile on CUDA is one page, so the page
size sets how many keys each step of its loop reads. On the CPU (the dry run)
the same code profiles CPU operations. A few more decode steps then run under
Python's own profiler: the host's time by Python function (PyTorch's profiler
sees only the operators), which is what a step's host time is made of.
"""

from __future__ import annotations

import random
import time
from typing import Any

# Decode steps recorded per run, after this many unprofiled warm-up steps.
PROFILED_STEPS = 5
WARMUP_STEPS = 3
# Kernels and host operations listed per run.
TOP_KERNELS = 12
# Python functions listed per run (by the host's own time in them).
PYTHON_ROWS = 25
# Prompt lengths (the sweep's) and output tokens per request: enough that the first
# requests are still decoding when the last prompt is in (at 8192 prompt tokens a step,
# 256 prompts take about ten steps).
PROMPT_TOKENS = (128, 512)
OUTPUT_TOKENS = 256


def profile_decode(
    model: str, device: str, runs: tuple[tuple[int, int], ...], max_model_len: int = 2048
) -> dict[str, Any]:
    """Profile decode steps of ``model`` for each (sequences, KV block size) of ``runs``;
    returns the tables by ``"<sequences>x<block size>"``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvserve.engine import LLMEngine
    from kvserve.sampling_params import SamplingParams

    on_cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    results: dict[str, Any] = {}
    for n, block_size in runs:
        # A pool that holds every request whole: with the default pool the largest batch
        # preempts, a recomputed prompt makes every step a mixed one, and no step is the
        # decode-only step of ``n`` rows this profiles.
        blocks_per_request = -(-(PROMPT_TOKENS[1] + OUTPUT_TOKENS) // block_size) + 1
        engine = LLMEngine.from_engine_args(
            model,
            device=device,
            max_num_seqs=n,
            max_model_len=max_model_len,
            seed=0,
            block_size=block_size,
            num_blocks=n * blocks_per_request + 1,
            max_num_batched_tokens=8192,
        )
        rng = random.Random(n)
        # Long enough outputs that the first requests are still decoding when the last
        # prompt is in: only then is a step decode-only with all ``n`` rows.
        params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        vocab = min(engine.runner.vocab_size, 40000)  # a tiny model's vocabulary is smaller
        # n requests to decode, and n more queued behind them, as in the sweep (2 x n): the
        # scheduler looks at the queue every step.
        for i in range(2 * n):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
            engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
        decode_steps = 0
        while decode_steps < WARMUP_STEPS and engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats
            if stats.num_prefill_tokens == 0 and stats.num_decode_tokens == n:
                decode_steps += 1
        if decode_steps < WARMUP_STEPS:
            raise RuntimeError(f"{n} requests never decoded together; outputs are too short")
        walls, waits = [], []
        with profile(activities=activities) as prof:
            for _ in range(PROFILED_STEPS):
                waited = engine.runner.device_wait_s
                start = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - start)
                waits.append(engine.runner.device_wait_s - waited)
                if engine.stats.num_prefill_tokens or engine.stats.num_decode_tokens != n:
                    raise RuntimeError(f"a profiled step was not a decode step of {n} rows")
        summary = _summarise(prof, walls, waits, on_cuda)
        summary["top_python"] = _python_profile(engine, n)
        results[f"{n}x{block_size}"] = summary
        del engine
        if on_cuda:
            torch.cuda.empty_cache()
    return results


def _python_profile(engine: Any, n: int) -> list[dict[str, Any]]:
    """The host's own time per Python function (``tottime``) over a few decode steps of
    ``n`` rows, with what each calls (``cumtime``), per step: the top ones."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    steps = 0
    for _ in range(PROFILED_STEPS):
        if not engine.has_unfinished_requests():
            break
        profiler.enable()
        engine.step()
        profiler.disable()
        steps += 1
    if not steps:
        return []
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, function), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{path.rsplit('/site-packages/', 1)[-1].rsplit('/src/', 1)[-1]}:{line}"
        rows.append(
            {
                "name": f"{function} ({where})"[:90],
                "ms": round(1e3 * own / steps, 4),
                "cum_ms": round(1e3 * cumulative / steps, 4),
                "per_step": round(calls / steps, 1),
            }
        )
    rows.sort(key=lambda r: -r["ms"])
    return rows[:PYTHON_ROWS]


def _summarise(prof: Any, walls: list[float], waits: list[float], on_cuda: bool) -> dict[str, Any]:
    """Per-step means: wall, device wait, kernel time and launches; the top kernels and ops."""
    steps = len(walls)
    events = prof.key_averages()
    kernels = []
    host_ops = []
    for event in events:
        device_us = getattr(event, "self_device_time_total", 0.0) if on_cuda else 0.0
        if on_cuda and device_us > 0 and event.device_type.name == "CUDA":
            kernels.append((event.key, device_us / steps / 1e3, event.count / steps))
        elif event.self_cpu_time_total > 0:
            host_ops.append(
                (event.key, event.self_cpu_time_total / steps / 1e3, event.count / steps)
            )
    kernels.sort(key=lambda k: -k[1])
    host_ops.sort(key=lambda k: -k[1])
    return {
        "steps": steps,
        "wall_ms": 1e3 * sum(walls) / steps,
        "device_wait_ms": 1e3 * sum(waits) / steps,
        "kernel_ms": sum(k[1] for k in kernels),
        "launches": sum(k[2] for k in kernels),
        "top_kernels": [
            {"name": name[:90], "ms": round(ms, 4), "per_step": round(count, 1)}
            for name, ms, count in kernels[:TOP_KERNELS]
        ],
        "top_host_ops": [
            {"name": name[:90], "ms": round(ms, 4), "per_step": round(count, 1)}
            for name, ms, count in host_ops[:TOP_KERNELS]
        ],
    }


def markdown(results: dict[str, Any]) -> list[str]:
    """The tables as lines of text, one block per run."""
    lines = []
    for run, r in results.items():
        n, block_size = run.split("x")
        lines.append(
            f"{n} sequences, KV blocks of {block_size} tokens: {r['wall_ms']:.2f} ms a decode "
            "step (wall), of which the host "
            f"waited {r['device_wait_ms']:.2f} ms for the device; kernels {r['kernel_ms']:.2f} "
            f"ms in {r['launches']:.0f} launches a step (means of {r['steps']} steps)"
        )
        for title, rows in (("kernel", r["top_kernels"]), ("host op", r["top_host_ops"])):
            if not rows:
                continue
            lines.append(f"| {title} | ms/step | calls/step |")
            lines += [f"| {k['name']} | {k['ms']:.3f} | {k['per_step']:.1f} |" for k in rows]
        if r.get("top_python"):
            lines.append(
                "| Python function (host, under cProfile) | own ms/step | with callees | calls/step |"
            )
            lines += [
                f"| {k['name']} | {k['ms']:.3f} | {k['cum_ms']:.3f} | {k['per_step']:.1f} |"
                for k in r["top_python"]
            ]
    return lines
