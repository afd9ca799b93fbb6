"""Column- and row-parallel linears keep their rank's slice of each whole checkpoint tensor."""

from __future__ import annotations

import pytest
import torch

from kvserve.distributed.group import TensorParallelGroup
from kvserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear

# Loading needs a rank and a size only; no process group.
SECOND_OF_TWO = TensorParallelGroup(rank=1, size=2)


def test_a_column_parallel_layer_keeps_its_rows_of_each_shard() -> None:
    layer = ColumnParallelLinear(3, tp=SECOND_OF_TWO, shards={"q": 4, "k": 2, "v": 2}, bias=True)
    q, k = torch.arange(12.0).view(4, 3), torch.arange(6.0).view(2, 3) + 100
    layer.load("weight", q, "q")
    layer.load("weight", k, "k")
    layer.load("bias", torch.tensor([1.0, 2.0, 3.0, 4.0]), "q")
    assert layer.weight.shape == (4, 3)
    torch.testing.assert_close(layer.weight[:2], q[2:])
    torch.testing.assert_close(layer.weight[2:3], k[1:])
    torch.testing.assert_close(layer.bias[:2], torch.tensor([3.0, 4.0]))


def test_a_row_parallel_layer_keeps_its_columns_and_rank_0_alone_the_bias() -> None:
    layer = RowParallelLinear(4, 3, tp=SECOND_OF_TWO, bias=True)
    weight = torch.arange(12.0).view(3, 4)
    layer.load("weight", weight)
    layer.load("bias", torch.ones(3))
    torch.testing.assert_close(layer.weight, weight[:, 2:])
    torch.testing.assert_close(layer.bias, torch.zeros(3))


def test_a_checkpoint_tensor_of_the_wrong_whole_shape_is_refused() -> None:
    column = ColumnParallelLinear(3, 4, tp=SECOND_OF_TWO)
    with pytest.raises(ValueError, match=r"expected \(4, 3\)"):
        column.load("weight", torch.zeros(6, 3))
    row = RowParallelLinear(4, 3, tp=SECOND_OF_TWO)
    with pytest.raises(ValueError, match=r"expected \(3, 4\)"):
        row.load("weight", torch.zeros(3, 2))


def test_sizes_that_do_not_split_evenly_are_refused() -> None:
    with pytest.raises(ValueError, match="does not split evenly over 2 ranks"):
        ColumnParallelLinear(3, tp=SECOND_OF_TWO, shards={"q": 3})
