"""The default KV pool is sized to the expected work; explicit settings still win; the pool's
memory becomes resident only as it is written."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import psutil
import pytest
import torch

from kvserve.config import CacheConfig
from kvserve.core.kv_cache_groups import make_kv_cache_groups
from kvserve.models.arch_config import ArchConfig
from kvserve.worker import kv_pool
from kvserve.worker.kv_pool import (
    expected_kv_blocks,
    kv_bytes_per_sequence,
    kv_cache_bytes_per_block,
    num_kv_blocks,
    zeroed_pool,
)

GIB = 1024**3

# SmolLM2-135M's shape: 30 layers of 3 KV heads of 64 dimensions.
SMOLLM2 = ArchConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Set ``available[0]`` to the bytes of memory the runner sees as available."""
    memory = [24 * GIB]
    fake = SimpleNamespace(virtual_memory=lambda: SimpleNamespace(available=memory[0]))
    monkeypatch.setattr(kv_pool, "psutil", fake)
    return memory


def blocks(
    cache: CacheConfig,
    max_model_len: int = 8192,
    max_num_seqs: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    return num_kv_blocks(cache, SMOLLM2, dtype, max_model_len, max_num_seqs)


@pytest.mark.parametrize(
    ("max_num_seqs", "max_model_len", "block_size", "expected"),
    [
        (128, 8192, 16, 128 * 32 + 1),  # the defaults with SmolLM2: 65,536 tokens
        (16, 8192, 16, 512 + 1),  # 16 x 512 tokens < one 8192-token sequence
        (1, 8192, 16, 512 + 1),
        (128, 256, 16, 128 * 16 + 1),  # short contexts need less than 512 each
        (4, 1000, 32, 4 * 16 + 1),  # 512 tokens = 16 blocks of 32
        (3, 100, 16, 3 * 7 + 1),  # 100 tokens = 7 blocks of 16
    ],
)
def test_expected_blocks(
    max_num_seqs: int, max_model_len: int, block_size: int, expected: int
) -> None:
    assert expected_kv_blocks(max_num_seqs, max_model_len, block_size) == expected


def test_default_pool_is_what_the_expected_load_uses(available: list[int]) -> None:
    per_block = kv_cache_bytes_per_block(SMOLLM2, 16, torch.bfloat16)
    assert per_block == 16 * 30 * 2 * 3 * 64 * 2
    assert blocks(CacheConfig()) == 4097  # 1.41 GiB instead of the 4 GiB cap
    assert blocks(CacheConfig(), dtype=torch.float32) == 4097
    assert blocks(CacheConfig(), max_num_seqs=8) == 513


def test_memory_budget_still_caps_the_default_pool(available: list[int]) -> None:
    available[0] = 2 * GIB  # a fifth: 0.4 GiB
    per_block = kv_cache_bytes_per_block(SMOLLM2, 16, torch.bfloat16)
    assert blocks(CacheConfig()) == int(2 * GIB * 0.2) // per_block < 4097


def test_explicit_settings_win(available: list[int]) -> None:
    per_block = kv_cache_bytes_per_block(SMOLLM2, 16, torch.bfloat16)
    by_bytes = blocks(CacheConfig(kv_cache_memory_bytes=3 * GIB))
    assert by_bytes == 3 * GIB // per_block > 4097
    by_fraction = blocks(CacheConfig(kv_cache_memory_fraction=0.25))
    assert by_fraction == 6 * GIB // per_block
    assert blocks(CacheConfig(num_blocks=10)) == 10
    # Still no more than max_num_seqs full-length sequences can use.
    assert blocks(CacheConfig(kv_cache_memory_bytes=3 * GIB), max_num_seqs=2) == 2 * 512 + 1


@pytest.mark.parametrize("max_num_seqs", [1, 2, 7, 128])
@pytest.mark.parametrize("max_model_len", [16, 100, 513, 2048, 8192, 32768])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_default_pool_holds_one_full_length_sequence(
    available: list[int], max_num_seqs: int, max_model_len: int, block_size: int
) -> None:
    num_blocks = blocks(CacheConfig(block_size=block_size), max_model_len, max_num_seqs)
    assert (num_blocks - 1) * block_size >= max_model_len  # the null block holds nothing
    # ... and never more than the old rule (max_num_seqs full-length sequences) gave.
    assert num_blocks <= max_num_seqs * -(-max_model_len // block_size) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_pool_reads_zero_and_keeps_writes(dtype: torch.dtype) -> None:
    pool = zeroed_pool(4, 2, 8, 16, 3, 64, dtype=dtype, device=torch.device("cpu"))
    assert pool.shape == (4, 2, 8, 16, 3, 64) and pool.dtype == dtype
    assert pool.is_contiguous() and pool.data_ptr() % 64 == 0
    assert not pool.any()
    pool[1, 0, 3].fill_(2.0)
    assert pool.sum().item() == 2.0 * 16 * 3 * 64


def test_zeroed_pool_becomes_resident_only_where_written() -> None:
    process = psutil.Process()
    before = process.memory_info().rss
    pool = zeroed_pool(GIB // 4, dtype=torch.float32, device=torch.device("cpu"))  # 1 GiB
    untouched = process.memory_info().rss - before
    pool[: 16 * 1024**2 // 4].fill_(1.0)  # 16 MiB
    written = process.memory_info().rss - before
    assert untouched < 64 * 1024**2
    assert 16 * 1024**2 <= written < 96 * 1024**2


# Gemma 3 270M's shape: 18 layers (15 with a 512-token window, 3 global), 1 KV head of 256.
GEMMA3_270M = dataclasses.replace(
    SMOLLM2,
    num_hidden_layers=18,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=32768,
)
GEMMA3_GROUPS = make_kv_cache_groups([None if (i + 1) % 6 == 0 else 512 for i in range(18)])


def test_a_grouped_pool_block_holds_one_group_of_layers() -> None:
    per_layer = 2 * 1 * 256 * 2 * 16  # K and V, 1 head of 256, bf16, 16 tokens
    assert kv_cache_bytes_per_block(GEMMA3_270M, 16, torch.bfloat16) == 18 * per_layer
    assert kv_cache_bytes_per_block(GEMMA3_270M, 16, torch.bfloat16, 3) == 3 * per_layer


def test_gemma3_holds_over_four_times_less_kv_per_sequence_at_8192_tokens() -> None:
    def held(keep_full_history: bool) -> int:
        return kv_bytes_per_sequence(
            GEMMA3_270M, GEMMA3_GROUPS, 8192, 16, torch.bfloat16, keep_full_history
        )

    per_layer_block = 2 * 256 * 2 * 16
    # Every layer keeps 512 blocks; hybrid: the global group 512, each sliding group 33.
    assert held(True) == 18 * 512 * per_layer_block
    assert held(False) == 3 * (512 + 5 * 33) * per_layer_block
    assert held(True) / held(False) > 4.5


def test_the_default_pool_counts_what_each_group_holds(available: list[int]) -> None:
    windows = tuple(g.sliding_window for g in GEMMA3_GROUPS)
    # 8 sequences of 512 tokens: the global group 32 blocks each, a sliding group 32
    # (512 tokens fit the window), plus one 512-token chunk in flight per sliding group.
    assert expected_kv_blocks(8, 8192, 16, windows, 512) == 8 * 6 * 32 + 5 * 32 + 1
    # One 8192-token sequence in chunks of 512: 512 global blocks + 5 x 65.
    assert expected_kv_blocks(1, 8192, 16, windows, 512) == 512 + 5 * 65 + 1
    num_blocks = num_kv_blocks(
        CacheConfig(), GEMMA3_270M, torch.bfloat16, 8192, 8, GEMMA3_GROUPS, 512
    )
    assert num_blocks == 8 * 6 * 32 + 5 * 32 + 1
    # A memory budget is spent in blocks of 3 layers, never past what 8 sequences use.
    budget = CacheConfig(kv_cache_memory_bytes=GIB)
    per_block = kv_cache_bytes_per_block(GEMMA3_270M, 16, torch.bfloat16, 3)
    useful = 8 * (512 + 5 * 65) + 1
    assert num_kv_blocks(budget, GEMMA3_270M, torch.bfloat16, 8192, 8, GEMMA3_GROUPS, 512) == min(
        GIB // per_block, useful
    )
