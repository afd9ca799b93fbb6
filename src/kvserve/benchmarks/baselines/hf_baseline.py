"""Hugging Face transformers on the same weights: the baselines kvserve is measured against.

- static batching: ``generate()`` on left-padded batches in arrival order;
  each batch runs until its longest request is done, and only each request's
  own tokens count as output;
- transformers' own continuous batching (``init_continuous_batching``),
  where it runs on this machine;
- single-request ``generate()`` for latency.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from kvserve.benchmarks.common import Metrics
from kvserve.loader import ModelSource


def load_hf_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> PreTrainedModel:
    """The transformers model for the same checkpoint kvserve loads (GGUFs are dequantized),
    on ``device``: the one kvserve ran on, so that both are measured on the same hardware."""
    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    # nn.Module.to, which transformers wraps in a decorator that hides its signature.
    return cast(PreTrainedModel, cast(Any, model).to(device).eval())


def synchronize(model: PreTrainedModel) -> None:
    """Wait for ``model``'s device to finish its queued work (a no-op on CPU), before a clock read."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


@torch.inference_mode()
def generate_exact(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_tokens: int,
    pad_token_id: int,
) -> torch.Tensor:
    """Greedy ``generate()`` of exactly ``num_tokens`` tokens (EOS does not stop it)."""
    # nn.Module's __getattr__ hides generate() from the type checker.
    return cast(Any, model).generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )


def static_batching(
    model: PreTrainedModel,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    batch_size: int,
    pad_token_id: int,
) -> Metrics:
    """Run the workload as left-padded batches of ``batch_size`` in arrival order."""
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        longest = max(len(p) for p in batch)
        input_ids = torch.tensor(
            [[pad_token_id] * (longest - len(p)) + p for p in batch], device=model.device
        )
        attention_mask = torch.tensor(
            [[0] * (longest - len(p)) + [1] * len(p) for p in batch], device=model.device
        )
        generate_exact(
            model,
            input_ids,
            attention_mask,
            max(output_lens[first : first + batch_size]),
            pad_token_id,
        )
    synchronize(model)
    elapsed = time.perf_counter() - start
    return {"wall_s": elapsed}


def continuous_batching(
    model: PreTrainedModel, prompts: Sequence[list[int]], output_lens: Sequence[int]
) -> Metrics:
    """Run the workload through transformers' continuous batching manager."""
    manager = cast(Any, model).init_continuous_batching()
    start = time.perf_counter()
    manager.start()
    try:
        pending = {
            manager.add_request(list(p), max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(prompts, output_lens, strict=True)
        }
        while pending:
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if result.is_finished():
                pending.discard(result.request_id)
    finally:
        manager.stop(block=True, timeout=10)
    return {"wall_s": time.perf_counter() - start}


def single_request_latency(
    model: PreTrainedModel, prompt: list[int], num_tokens: int, pad_token_id: int
) -> Metrics:
    """TTFT (a 1-token generate) and ms per output token over ``num_tokens`` tokens."""
    input_ids = torch.tensor([prompt], device=model.device)
    attention_mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    generate_exact(model, input_ids, attention_mask, 1, pad_token_id)
    synchronize(model)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    generate_exact(model, input_ids, attention_mask, num_tokens, pad_token_id)
    synchronize(model)
    total = time.perf_counter() - start
    return {"ttft_s": ttft, "ms_per_token": 1000 * (total - ttft) / (num_tokens - 1)}
