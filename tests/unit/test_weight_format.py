"""Every weight format of a Linear computes ``F.linear`` on the same weights.

The reference is always PyTorch's ``F.linear`` on the float weight the format
stores (for a quantized weight: gguf's own dequantizer of its blocks).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import quantize

from kvserve.config import EngineConfig
from kvserve.errors import InvalidParameterError
from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.kernels.weight_kind import WeightKind
from kvserve.layers.linear import Linear
from kvserve.layers.weight_format import (
    NATIVE_MAX_ROWS,
    KernelBF16Weights,
    KernelF32Weights,
    PackedBF16Weights,
    QuantizedWeights,
    TorchWeights,
)
from kvserve.worker.cpu_weights import (
    can_prepack,
    prepack_linear_weights,
    store_linear_weights_in_bf16,
    use_linear_kernels,
)

Q = gguf.GGMLQuantizationType
IN = 64
SHARDS = {"q": 32, "k": 16, "v": 16}


def quantized(rows: int, qtype: Q, seed: int) -> QuantizedTensor:
    values = np.random.default_rng(seed).standard_normal((rows, IN)).astype(np.float32)
    return QuantizedTensor(qtype, rows, IN, torch.from_numpy(quantize(values, qtype)))


def float_layer(dtype: torch.dtype, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(IN, shards=SHARDS, bias=bias, dtype=dtype)
    layer.weight.data.normal_()
    if layer.bias is not None:
        layer.bias.data.normal_()
    return layer


def reference(layer: Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), weight.float(), bias)


@pytest.fixture
def ops() -> NativeOps:
    ops = native_ops()
    if ops is None:
        pytest.skip("the C kernels could not be built here")
    return ops


def test_a_new_layer_multiplies_with_pytorch() -> None:
    layer = float_layer(torch.float32)
    assert isinstance(layer.format, TorchWeights)
    x = torch.randn(5, IN)
    torch.testing.assert_close(layer(x), reference(layer, layer.weight, x), rtol=0, atol=0)


@pytest.mark.parametrize("num_rows", [1, 7, NATIVE_MAX_ROWS + 1])
def test_kernel_formats_equal_f_linear(ops: NativeOps, num_rows: int) -> None:
    for dtype, fmt in ((torch.float32, KernelF32Weights), (torch.bfloat16, KernelBF16Weights)):
        # As the CPU plan stores them: bf16 weights, float32 biases and activations.
        layer = float_layer(torch.float32)
        if dtype == torch.bfloat16:
            store_linear_weights_in_bf16(layer)
        use_linear_kernels(layer, ops)
        assert isinstance(layer.format, fmt)
        x = torch.randn(num_rows, IN)
        # The AVX512-BF16 dot products round the activations to bf16 (2^-9 relative):
        # outputs of about 8 then move by a few hundredths.
        atol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(
            layer(x), reference(layer, layer.weight, x), rtol=1e-4, atol=atol
        )
        decode = layer.format.decode_weight(layer)
        assert decode is not None and decode.pointer == layer.weight.data_ptr()
        assert decode.kind == ops.weight_kind(dtype)


@pytest.mark.skipif(
    not can_prepack(torch.bfloat16, torch.device("cpu")), reason="no bf16 units: never packed"
)
def test_packed_format_equals_f_linear() -> None:
    layer = float_layer(torch.bfloat16)
    plain = layer.weight.detach().clone()
    prepack_linear_weights(layer)
    assert isinstance(layer.format, PackedBF16Weights)
    assert layer.format.decode_weight(layer) is None  # the one-call stack cannot read it
    x = torch.randn(3, IN).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x, plain, layer.bias), rtol=0, atol=0)


def test_quantized_shards_become_one_quantized_weight_and_free_the_float_one() -> None:
    layer = Linear(IN, shards=SHARDS, bias=True)
    assert layer.bias is not None
    layer.bias.data.normal_()
    pieces = {"q": quantized(32, Q.Q4_1, 1), "k": quantized(16, Q.Q4_1, 2)}
    pieces["v"] = quantized(16, Q.Q8_0, 3)
    for name in ("v", "q", "k"):  # arrival order is not row order
        layer.load("weight", pieces[name], name)
    fmt = layer.format
    assert isinstance(fmt, QuantizedWeights)
    # q and k share a type: one segment; v its own.
    assert [(s.qtype, s.rows) for s in fmt.qweight.segments] == [(Q.Q4_1, 48), (Q.Q8_0, 16)]
    assert layer.weight.numel() == 0
    dense = torch.cat([pieces[name].dequantize() for name in SHARDS])
    x = torch.randn(6, IN)
    # Without the kernels: PyTorch on the dequantized weight, the same math.
    torch.testing.assert_close(layer(x), reference(layer, dense, x), rtol=1e-5, atol=1e-5)
    assert fmt.decode_weight(layer) is None
    with pytest.raises(RuntimeError, match="QuantizedWeights"):
        layer.load("weight", pieces["q"], "q")


def test_quantized_format_takes_the_kernels(ops: NativeOps) -> None:
    layer = Linear(IN, 32)
    layer.load("weight", quantized(32, Q.Q8_0, 4))
    use_linear_kernels(layer, ops)
    fmt = layer.format
    assert isinstance(fmt, QuantizedWeights) and fmt.ops is ops
    x = torch.randn(4, IN)
    dense = fmt.qweight.dequantize()
    # int8 activations: each product is off by ~1% of its scale.
    decode = fmt.decode_weight(layer)
    assert decode is not None and decode.kind == WeightKind.QUANT
    scale = reference(layer, dense, x).abs().max().item()
    torch.testing.assert_close(layer(x), reference(layer, dense, x), rtol=0, atol=0.02 * scale)


def test_mixed_quantized_and_float_shards_dequantize_into_the_float_weight() -> None:
    layer = Linear(IN, shards=SHARDS, dtype=torch.float32)
    q = quantized(32, Q.Q5_0, 5)
    k, v = torch.randn(16, IN), torch.randn(16, IN)
    layer.load("weight", q, "q")
    layer.load("weight", k, "k")
    layer.load("weight", v, "v")
    assert isinstance(layer.format, TorchWeights)
    torch.testing.assert_close(layer.weight.data, torch.cat([q.dequantize(), k, v]))


def test_a_quantized_piece_of_the_wrong_shape_is_refused_before_anything_changes() -> None:
    layer = Linear(IN, shards=SHARDS)
    with pytest.raises(ValueError, match="shape"):
        layer.load("weight", quantized(16, Q.Q8_0, 6), "q")
    assert isinstance(layer.format, TorchWeights) and layer.weight.shape == (64, IN)


def test_quantized_fallback_keeps_the_activations_dtype() -> None:
    # bf16 activations (no kernels, bf16 model): computed in float32, returned in bf16.
    layer = Linear(IN, 16, dtype=torch.bfloat16)
    piece = quantized(16, Q.Q4_0, 7)
    layer.load("weight", piece)
    x = torch.randn(3, IN).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x.float(), piece.dequantize()).bfloat16())


def test_quantizing_at_load_is_refused_over_several_ranks() -> None:
    # Row-parallel layers would split quantized blocks; 'auto' dequantizes there instead.
    with pytest.raises(
        InvalidParameterError,
        match="quantization: 'q8_0' cannot split quantized weights over ranks",
    ):
        EngineConfig.from_kwargs("m", quantization="q8_0", tensor_parallel_size=2)
    assert EngineConfig.from_kwargs("m", tensor_parallel_size=2).model_config.quantization == (
        "auto"
    )
