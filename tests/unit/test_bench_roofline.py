"""The benchmarks' FLOP counts follow the model's shapes; the driver times decode-only steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvserve.benchmarks.offline.engine_driver import BenchRequest, drive
from kvserve.benchmarks.offline.roofline import (
    decode_step_floor_s,
    decode_step_flops_per_s,
    flops_per_token,
    kv_read_bytes,
    weight_bytes,
    weight_count,
    workload_flops,
)
from kvserve.benchmarks.timings import DecodeStep, DriveResult
from kvserve.engine import LLMEngine
from model_fixtures import save_tiny_model, tiny_arch_config, train_tiny_tokenizer

ARCH = tiny_arch_config(vocab_size=1000)


def test_a_prompt_token_skips_the_lm_head() -> None:
    lm_head = 2.0 * ARCH.vocab_size * ARCH.hidden_size
    assert flops_per_token(ARCH, 10) - flops_per_token(ARCH, 10, lm_head=False) == lm_head
    # Attention grows with context: 4 FLOPs per head dimension, head and layer per key.
    assert flops_per_token(ARCH, 11) - flops_per_token(ARCH, 10) == 4 * 2 * 4 * 16


def test_a_sliding_layer_attends_to_its_window_only() -> None:
    windowed = dataclasses.replace(
        ARCH, sliding_window=8, layer_types=("sliding_attention", "full_attention")
    )
    per_key_and_layer = 4 * 4 * 16
    # Inside the window both layers attend to every key; past it only the global one does.
    assert flops_per_token(windowed, 8) == flops_per_token(ARCH, 8)
    assert flops_per_token(windowed, 9) - flops_per_token(windowed, 8) == per_key_and_layer
    assert flops_per_token(ARCH, 9) - flops_per_token(ARCH, 8) == 2 * per_key_and_layer


def test_a_decode_step_reads_each_rows_keys_once_in_every_layer() -> None:
    torch = pytest.importorskip("torch")
    # K and V: 2 KV heads of 16 dimensions, 2 layers; bf16 is 2 bytes.
    per_key = 2 * 2 * 16 * 2
    assert kv_read_bytes(ARCH, [10, 20], torch.bfloat16) == 2 * 30 * per_key
    windowed = dataclasses.replace(
        ARCH, sliding_window=8, layer_types=("sliding_attention", "full_attention")
    )
    assert kv_read_bytes(windowed, [20], torch.bfloat16) == (8 + 20) * per_key
    floor = decode_step_floor_s(ARCH, torch.bfloat16, 1000.0, memory_bytes_per_s=1e9)
    assert floor == pytest.approx((weight_bytes(ARCH, torch.bfloat16) + 1000) / 1e9)


def test_host_time_is_the_step_less_its_wait_for_the_device() -> None:
    assert DecodeStep(0.5, [10], wait_seconds=0.2).host_seconds == pytest.approx(0.3)
    assert DecodeStep(0.5, [10]).host_seconds == 0.5


def test_workload_flops_adds_prompts_and_outputs() -> None:
    expected = 8 * flops_per_token(ARCH, 4, lm_head=False) + 3 * flops_per_token(ARCH, 8 + 1)
    assert workload_flops(ARCH, [8], [3]) == expected
    assert workload_flops(ARCH, [8, 8], [3, 3]) == 2 * expected
    assert weight_count(ARCH) > 0


def test_decode_step_flops_count_only_full_batches() -> None:
    steps = [DecodeStep(0.5, [10, 20]), DecodeStep(1.0, [11]), DecodeStep(0.5, [11, 21])]
    expected = sum(flops_per_token(ARCH, c) for c in (10, 20, 11, 21)) / 1.0
    assert decode_step_flops_per_s(ARCH, steps, batch=2) == pytest.approx(expected)
    assert decode_step_flops_per_s(ARCH, steps, batch=3) == 0.0


def test_the_decode_rate_counts_only_full_batch_steps() -> None:
    steps = [DecodeStep(0.5, [10, 20]), DecodeStep(1.0, [11]), DecodeStep(0.25, [11, 21])]
    result = DriveResult([], wall_s=3.0, num_steps=5, decode_steps=steps)
    # Two full steps of two rows in 0.75 s; the one-row step is left out.
    assert result.decode_tok_per_s(2) == pytest.approx(4 / 0.75)
    assert result.decode_tok_per_s(3) == 0.0


def test_the_driver_records_decode_only_steps_with_their_contexts(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path, "llama", train_tiny_tokenizer())
    engine = LLMEngine.from_engine_args(str(model_dir), block_size=4, num_blocks=32)
    requests = [BenchRequest(list(range(3, 8)), 4), BenchRequest(list(range(20, 29)), 4)]
    result = drive(engine, requests)
    # Step 0 prefills both prompts (5 and 9 tokens) and samples each one's first token; the
    # three decode steps feed output k at position prompt + k - 1, attending to prompt + k keys.
    assert result.num_steps == 4
    assert [sorted(step.context_lens) for step in result.decode_steps] == [
        [6, 10],
        [7, 11],
        [8, 12],
    ]
    assert all(step.seconds > 0 for step in result.decode_steps)
