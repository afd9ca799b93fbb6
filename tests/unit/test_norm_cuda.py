"""RMSNorm's fused CUDA path against a float64 reference.

Skipped without a CUDA device. On CUDA ``RMSNorm`` calls PyTorch's fused
kernel instead of the float32 sequence the CPU runs; it must give the same
values: within float32 rounding in float32, and within one bfloat16 rounding
of the result in bfloat16 (the reference rounds the normalised value before
multiplying by the weight, as Hugging Face's Llama does; the fused kernel
rounds once at the end).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 576), (5, 9, 64)])
def test_the_fused_cuda_rms_norm_matches_float64(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6, dtype).cuda()
    norm.weight.copy_(torch.randn(shape[-1]) * 0.5 + 1.0)
    x = (torch.randn(shape) * 3.0).to(dtype).cuda()
    got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    want = reference(x, norm.weight, norm.eps)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        # Two bf16 roundings of a value of magnitude ~|want|: 2^-7 relative each.
        torch.testing.assert_close(got.double(), want, rtol=2 * 2**-8, atol=1e-2)


def test_add_and_norm_on_cuda_returns_the_sum_and_its_norm() -> None:
    torch.manual_seed(1)
    norm = RMSNorm(256, 1e-5, torch.float32).cuda()
    norm.weight.copy_(torch.rand(256) + 0.5)
    x, residual = torch.randn(4, 256).cuda(), torch.randn(4, 256).cuda()
    normed, summed = norm.add_and_norm(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(
        normed.double(), reference(x + residual, norm.weight, norm.eps), rtol=1e-5, atol=1e-5
    )
