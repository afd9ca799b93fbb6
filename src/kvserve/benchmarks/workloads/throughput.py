"""The throughput benchmark's workload: the prompts, their output lengths, the rates they give.

Every system under comparison runs the same ``Workload``; ``with_rates`` turns
one system's wall time into requests, output tokens and all tokens per second.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.benchmarks.common import Metrics
from kvserve.benchmarks.workloads.prompts import prompts_of_lengths
from kvserve.loader import ModelSource
from kvserve.models.arch_config import ArchConfig

if TYPE_CHECKING:
    from kvserve.loader.fast_tokenizer import AnyTokenizer


def make_workload(
    tokenizer: AnyTokenizer,
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompt_lens = [rng.randint(*input_len) for _ in range(num_requests)]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return prompts_of_lengths(tokenizer, prompt_lens, seed), output_lens


def warmup_workload(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """A few of the prompts with short outputs: enough to load and warm each system."""
    few = prompts[:4]
    return few, [8] * len(few)


def with_rates(metrics: Metrics, prompts: list[list[int]], output_lens: list[int]) -> Metrics:
    num_output = sum(output_lens)
    num_total = num_output + sum(len(p) for p in prompts)
    wall = metrics["wall_s"]
    return {
        **metrics,
        "requests_per_s": len(prompts) / wall,
        "output_tok_per_s": num_output / wall,
        "total_tok_per_s": num_total / wall,
    }


@dataclass
class Workload:
    """The prompts and output lengths, and what the baselines need to load the same model.

    device: where kvserve ran, so where the transformers baselines run too.
    """

    prompts: list[list[int]]
    output_lens: list[int]
    source: ModelSource
    arch: ArchConfig
    dtype: torch.dtype
    pad_token_id: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def first(self, num_requests: int | None) -> Workload:
        """The workload of the first ``num_requests`` requests (None: all of them)."""
        if num_requests is None:
            return self
        return dataclasses.replace(
            self,
            prompts=self.prompts[:num_requests],
            output_lens=self.output_lens[:num_requests],
        )
