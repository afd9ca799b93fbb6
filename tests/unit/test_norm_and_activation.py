"""The shared LayerNorm and GELU compute what transformers' GPT-2 layers compute."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from kvserve.kernels import native_ops
from kvserve.layers.activation import GELU, GELU_APPROXIMATIONS
from kvserve.layers.norm import LayerNorm


@pytest.mark.parametrize("name", sorted(GELU_APPROXIMATIONS))
def test_each_gelu_name_computes_the_transformers_activation_of_that_name(name: str) -> None:
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(GELU.named(name)(x), ACT2FN[name](x), atol=1e-6, rtol=0)


def test_the_tanh_approximation_and_the_exact_gelu_differ() -> None:
    # Guards the test above: a name mapped to the wrong variant would be caught.
    x = torch.linspace(-6, 6, 1001)
    assert (GELU("tanh")(x) - GELU("none")(x)).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_matches_torch_in_float32_and_returns_the_input_dtype(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(0)
    reference = torch.nn.LayerNorm(48, eps=1e-5)
    with torch.no_grad():
        reference.weight.normal_(1.0, 0.2)
        reference.bias.normal_(0.0, 0.2)
    ours = LayerNorm(48, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(reference.weight)
        ours.bias.copy_(reference.bias)
    x = (3.0 * torch.randn(5, 48) + 1.0).to(dtype)
    out = ours(x)
    assert out.dtype == dtype
    expected = reference(x.float()).to(dtype)
    torch.testing.assert_close(out, expected, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


def test_the_c_kernels_compute_the_same_layer_norm_and_gelu() -> None:
    ops = native_ops()
    if ops is None:
        pytest.skip("the C kernels could not be built here")
    torch.manual_seed(1)
    norm = LayerNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
        norm.bias.normal_(0.0, 0.2)
    x, residual = torch.randn(7, 48), torch.randn(7, 48)
    want_normed, want_residual = norm.add_and_norm(x, residual.clone())
    want_plain = norm(x)
    gelu = GELU("tanh")
    want_gelu = gelu(3.0 * x)
    norm.native = gelu.native = ops
    got_residual = residual.clone()
    got_normed, got_residual = norm.add_and_norm(x, got_residual)
    torch.testing.assert_close(got_residual, want_residual, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_normed, want_normed, atol=1e-5, rtol=0)
    torch.testing.assert_close(norm(x), want_plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(gelu(3.0 * x), want_gelu, atol=1e-5, rtol=0)
