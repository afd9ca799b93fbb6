"""The greedy sampler's native argmax against torch.argmax, on every instruction set."""

from __future__ import annotations

import pytest
import torch
from test_sampler import FakeRequest

from kvserve.kernels import NativeOps
from kvserve.sample import Sampler, SamplingMetadata
from kvserve.sampling_params import SamplingParams


@pytest.mark.parametrize("cols", [1, 7, 8, 15, 16, 17, 100, 49152])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_argmax_rows_matches_torch(ops: NativeOps, rows: int, cols: int) -> None:
    torch.manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols)
    torch.testing.assert_close(ops.argmax_rows(x), x.argmax(dim=-1), rtol=0, atol=0)


def test_argmax_rows_takes_the_first_of_equal_maxima_and_the_first_nan(ops: NativeOps) -> None:
    x = torch.randn(6, 40)
    x[0, [3, 11, 30]] = 9.0  # ties in different lanes: the first index wins
    x[1, [12, 4]] = 9.0  # the later lane holds the earlier index
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, [5, 37]] = float("nan")  # a NaN wins, the first one
    x[4, 38] = float("nan")  # in the tail past the vector loop
    x[5, :] = 1.0
    x[5, 39] = 2.0  # the maximum is the very last element
    expected = torch.tensor([3, 4, 0, 5, 38, 39])
    torch.testing.assert_close(ops.argmax_rows(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(x.argmax(dim=-1), expected, rtol=0, atol=0)


def test_argmax_rows_refuses_what_it_cannot_read(ops: NativeOps) -> None:
    with pytest.raises(ValueError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        ops.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="columns"):
        ops.argmax_rows(torch.zeros(2, 0))


@pytest.mark.parametrize("num_random", [0, 2])
def test_the_sampler_takes_its_greedy_tokens_from_the_kernel(
    ops: NativeOps, num_random: int
) -> None:
    # All greedy (the sampler's short path) and greedy rows beside sampled ones.
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    greedy = [FakeRequest(SamplingParams(temperature=0.0))] * (5 - num_random)
    sampled = [FakeRequest(SamplingParams(temperature=0.8), seed=1)] * num_random
    calls: list[torch.Tensor] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return ops.argmax_rows(x)

    def metadata() -> SamplingMetadata:  # fresh: the seeded rows' generators advance
        return SamplingMetadata.from_requests(greedy + sampled, 300, logits.device)

    native = Sampler(torch.Generator().manual_seed(3), counted)(logits, metadata())
    plain = Sampler(torch.Generator().manual_seed(3))(logits, metadata())
    assert calls, "the greedy rows did not go through the kernel"
    assert torch.equal(native.sampled_token_ids, plain.sampled_token_ids)
    assert torch.equal(
        native.sampled_token_ids[: 5 - num_random], logits[: 5 - num_random].argmax(-1)
    )
