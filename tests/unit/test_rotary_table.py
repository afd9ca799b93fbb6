"""The rotary table grows as positions are reached and matches the whole table built at once."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.rotary import RotaryEmbedding


def full_table(rotary: RotaryEmbedding, num_positions: int) -> torch.Tensor:
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32), rotary.inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def test_a_huge_declared_context_costs_nothing_until_used() -> None:
    # A model file may declare 2^24 positions: 8 GiB of table at head_dim 64.
    rotary = RotaryEmbedding(64, 1 << 24, 10000.0, None, torch.float32)
    assert rotary.cos_sin_cache.shape[0] == RotaryEmbedding.INITIAL_POSITIONS


def test_growing_gives_the_same_rows_as_the_whole_table() -> None:
    rotary = RotaryEmbedding(64, 20000, 10000.0, None, torch.float32)
    expected = full_table(rotary, 20000)
    for positions in ([0, 3, 4095], [4096, 5000], [8191, 8192, 12345], [19999]):
        index = torch.tensor(positions)
        torch.testing.assert_close(rotary(index), expected[index], rtol=0, atol=0)
    assert rotary.cos_sin_cache.shape[0] == 20000


def test_a_position_past_the_model_is_refused() -> None:
    rotary = RotaryEmbedding(64, 5000, 10000.0, None, torch.float32)
    with pytest.raises(IndexError, match="position 5000"):
        rotary(torch.tensor([10, 5000]))
