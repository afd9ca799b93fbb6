"""The benchmarks' FLOP counts follow the model's shapes."""

from __future__ import annotations

from kvserve.benchmarks.roofline import flops_per_token, weight_count, workload_flops
from model_fixtures import tiny_arch_config

ARCH = tiny_arch_config(vocab_size=1000)


def test_a_prompt_token_skips_the_lm_head() -> None:
    lm_head = 2.0 * ARCH.vocab_size * ARCH.hidden_size
    assert flops_per_token(ARCH, 10) - flops_per_token(ARCH, 10, lm_head=False) == lm_head
    # Attention grows with context: 4 FLOPs per head dimension, head and layer per key.
    assert flops_per_token(ARCH, 11) - flops_per_token(ARCH, 10) == 4 * 2 * 4 * 16


def test_workload_flops_adds_prompts_and_outputs() -> None:
    expected = 8 * flops_per_token(ARCH, 4, lm_head=False) + 3 * flops_per_token(ARCH, 8 + 1)
    assert workload_flops(ARCH, [8], [3]) == expected
    assert workload_flops(ARCH, [8, 8], [3, 3]) == 2 * expected
    assert weight_count(ARCH) > 0
