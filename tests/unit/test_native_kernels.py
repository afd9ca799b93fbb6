"""The C kernels compute what the PyTorch code they replace computes.

Each kernel is compared with the plain PyTorch expression (or the PyTorch
attention backend) on random inputs whose shapes exercise the kernels' tiles
and their remainders: rows not a multiple of the row tile, output features not
a multiple of the weight panel, sequence lengths not a multiple of the block
size, block tables in random order.
"""

from __future__ import annotations

import platform
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention import AttentionLayout, TorchPagedAttention, TorchPagedMetadata
from kvserve.kernels import NativeOps
from kvserve.kernels.build import load_library
from kvserve.kernels.decode_stack import DecodeLayerWeights, DecodeStack, NormKind
from kvserve.kernels.weight_kind import WeightKind
from kvserve.layers.rotary import RotaryEmbedding, apply_rotary
from native_targets import cpu_flags


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 64, 131])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (37, 13), (8, 25)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_torch(
    ops: NativeOps, num_rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    torch.manual_seed(num_rows * 1000 + in_features)
    x = torch.randn(num_rows, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    torch.testing.assert_close(
        ops.linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4
    )


def bf16_paths(ops: NativeOps) -> list[NativeOps]:
    """The portable bf16-weight kernel, and the AVX512-BF16 one where the build has it."""
    paths = [NativeOps(ops.lib, bf16_dot=False)]
    if ops.bf16_dot:
        paths.append(NativeOps(ops.lib, bf16_dot=True))
    return paths


def test_the_bf16_dot_product_kernel_is_built_where_the_cpu_has_it() -> None:
    # Otherwise the tests below would quietly exercise only the portable path.
    native = load_library()
    if native is None:
        pytest.skip("the C kernels could not be built here")
    assert bool(native.kv_has_bf16_dot()) == ("avx512_bf16" in cpu_flags())
    if platform.machine() == "x86_64" and "avx2" in cpu_flags():
        avx2_build = load_library("x86-64-v3")
        assert avx2_build is not None and not avx2_build.kv_has_bf16_dot()


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 6, 8, 17, 64, 131, 600])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (40, 27), (70, 37), (33, 5)])
def test_linear_with_bf16_weights_on_every_path(
    ops: NativeOps, num_rows: int, in_features: int, out_features: int
) -> None:
    torch.manual_seed(num_rows * 100 + in_features)
    x = torch.randn(num_rows, in_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features)
    for path in bf16_paths(ops):
        # The portable kernel widens the weights exactly; the dot-product kernel also
        # rounds the rows of x to bf16 (as the instruction takes bf16 pairs).
        rows = x.to(torch.bfloat16).float() if path.bf16_dot else x
        expected = F.linear(rows, weight.float(), bias)
        actual = path.linear(x, weight, bias)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def decode_inputs(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TorchPagedMetadata]:
    num_seqs = len(seq_lens)
    width = -(-max(seq_lens) // block_size)
    kv_cache = torch.randn(2, num_seqs * width + 1, block_size, num_kv_heads, head_dim)
    # Each row owns distinct blocks in shuffled order; short rows are padded with block 0.
    blocks = (torch.randperm(num_seqs * width) + 1).view(num_seqs, width)
    for row, length in enumerate(seq_lens):
        blocks[row, -(-length // block_size) :] = 0
    query = torch.randn(num_seqs, num_heads, head_dim)
    layout = AttentionLayout(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long),
        num_decode_tokens=num_seqs,
        decode_block_tables=blocks,
        decode_seq_lens=torch.tensor(seq_lens),
        prefills=(),
        block_size=block_size,
    )
    # The PyTorch backend's own metadata (its decode mask): it is the reference here.
    metadata = TorchPagedAttention().build_group(layout, torch.float32, kv_cache.shape[1])
    return query, kv_cache, blocks, metadata


@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        ([1, 2, 17, 33, 64], 9, 3, 64, 16),  # SmolLM2's heads; lengths off the block edges
        ([5, 300, 129], 4, 4, 16, 4),  # no grouping
        ([40, 7], 8, 1, 32, 8),  # one KV head for all
        ([1000], 9, 3, 64, 16),  # one long sequence: its tokens are split across threads
        ([700, 3], 4, 1, 256, 16),  # Gemma 3 270M's heads: long rows, a group of four
        ([130, 61], 5, 1, 40, 7),  # a group of five; head_dim 32 + 8; blocks shorter than 8
        ([37, 5, 1], 6, 2, 96, 5),  # head_dim 64 + 32; odd block size: a key without a pair
    ],
)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_torch_backend(
    ops: NativeOps,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_threads: int,
    pool_dtype: torch.dtype,
) -> None:
    # The thread count decides how many parts a sequence is split into; every split must agree.
    torch.manual_seed(len(seq_lens))
    query, kv_cache, blocks, metadata = decode_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size
    )
    pool = kv_cache.to(pool_dtype)  # a bf16 pool is read in place
    scale = head_dim**-0.5
    # The same pool values widened: only the order of float32 sums may differ.
    expected = TorchPagedAttention._decode(query, pool.float(), metadata, scale)
    # The slots past each sequence's end hold garbage the kernel must never touch.
    poisoned = pool.clone()
    for row, length in enumerate(seq_lens):
        last = blocks[row, (length - 1) // block_size]
        poisoned[:, last, (length - 1) % block_size + 1 :] = float("nan")
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for path in bf16_paths(ops) if pool_dtype == torch.bfloat16 else [ops]:
            actual = path.paged_decode(
                query, poisoned, blocks, metadata.layout.decode_seq_lens, scale
            )
            if path.pool_kind(pool_dtype) == 2 and head_dim % 32 == 0:
                assert_within_bf16_weight_rounding(actual, query, pool, metadata, scale)
            else:
                torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
    # And the PyTorch backend, which widens a bf16 pool's gathered pages itself, agrees.
    torch_backend = TorchPagedAttention._decode(query, pool, metadata, scale)
    torch.testing.assert_close(torch_backend, expected, atol=1e-5, rtol=1e-5)


def assert_within_bf16_weight_rounding(
    actual: torch.Tensor,
    query: torch.Tensor,
    pool: torch.Tensor,
    metadata: TorchPagedMetadata,
    scale: float,
) -> None:
    """The AVX512-BF16 loops' result: the query and the softmax weights go through bf16.

    With the query rounded as the kernel rounds it, the only other change is each weight
    p_k off by at most 2^-9 of itself, so each output element is within
    2^-9 * sum_k p_k |v_k| / sum_k p_k of the exact one: attention over |V| gives the bound
    (doubled for the float32 exp and sums). A misplaced dimension or a wrong pair is far
    outside it.
    """
    rounded_query = query.to(torch.bfloat16).float()
    expected = TorchPagedAttention._decode(rounded_query, pool.float(), metadata, scale)
    magnitudes = torch.stack([pool[0].float(), pool[1].float().abs()])
    bound = TorchPagedAttention._decode(rounded_query, magnitudes, metadata, scale) * 2**-8
    excess = (actual - expected).abs() - bound - 1e-5
    assert excess.max() <= 0, f"off by {excess.max():.2e} past the bf16 weight rounding"


def test_paged_decode_reads_block_tables_sliced_from_a_wider_table(ops: NativeOps) -> None:
    # The decode rows' table is a column slice of the step's table when a prefill is longer.
    torch.manual_seed(5)
    query, kv_cache, blocks, metadata = decode_inputs([9, 30, 17], 4, 2, 16, 4)
    wide = torch.cat([blocks, torch.randint(1, 10, (3, 5))], dim=1)
    sliced = wide[:, : blocks.shape[1]]
    assert not sliced.is_contiguous()
    expected = TorchPagedAttention._decode(query, kv_cache, metadata, 0.25)
    actual = ops.paged_decode(query, kv_cache, sliced, metadata.layout.decode_seq_lens, 0.25)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_paged_decode_is_exact_on_large_scores(ops: NativeOps) -> None:
    # Scores in the hundreds: the softmax must subtract the maximum before exponentiating.
    torch.manual_seed(3)
    query, kv_cache, blocks, metadata = decode_inputs([50, 3], 2, 1, 16, 4)
    query = query * 40
    expected = TorchPagedAttention._decode(query, kv_cache, metadata, 1.0)
    actual = ops.paged_decode(query, kv_cache, blocks, metadata.layout.decode_seq_lens, 1.0)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_paged_decode_refuses_shapes_it_cannot_handle(ops: NativeOps) -> None:
    query, kv_cache, blocks, metadata = decode_inputs([3], 2, 1, 12, 4)  # head_dim % 8 != 0
    with pytest.raises(RuntimeError, match="refused"):
        ops.paged_decode(query, kv_cache, blocks, metadata.layout.decode_seq_lens, 1.0)


@pytest.mark.parametrize("num_rows", [1, 3, 40])
def test_rms_norm_with_and_without_residual(ops: NativeOps, num_rows: int) -> None:
    torch.manual_seed(num_rows)
    x, residual, weight = torch.randn(num_rows, 60), torch.randn(num_rows, 60), torch.randn(60)

    def reference(values: torch.Tensor) -> torch.Tensor:
        return values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    torch.testing.assert_close(ops.rms_norm(x, None, weight, 1e-5), reference(x))
    summed = x + residual
    out = ops.rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, summed)  # updated in place
    torch.testing.assert_close(out, reference(summed))


@pytest.mark.parametrize("num_rows", [1, 5, 33])
def test_rotary_in_place_matches_apply_rotary(ops: NativeOps, num_rows: int) -> None:
    torch.manual_seed(num_rows)
    num_heads, num_rotated, head_dim = 5, 4, 16  # the last head (a v head) stays as it is
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.float32)
    cos_sin = rotary(torch.randint(0, 4096, (num_rows,)))
    qkv = torch.randn(num_rows, num_heads * head_dim)
    heads = qkv.view(num_rows, num_heads, head_dim)
    expected = torch.cat([apply_rotary(heads[:, :num_rotated], cos_sin), heads[:, num_rotated:]], 1)
    ops.rotary_(qkv, cos_sin, num_rotated, head_dim)
    torch.testing.assert_close(heads, expected, atol=1e-5, rtol=1e-5)


def test_silu_mul_matches_torch_including_saturated_inputs(ops: NativeOps) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(7, 2 * 45) * 4
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -30.0, 30.0, 88.0, 200.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 32, 64])
def test_encoder_attention_matches_sdpa_within_each_sequence(ops: NativeOps, head_dim: int) -> None:
    """Each sequence attends to itself only: lengths 1 to 70 (tails past the 8-lane score
    loop), rows between sequences poisoned with NaN (never read, never written)."""
    torch.manual_seed(head_dim)
    heads = 3
    lens = [1, 5, 70, 1, 8, 17]
    starts, row = [], 0
    for length in lens:
        row += 1  # a poisoned row before each sequence
        starts.append(row)
        row += length
    qkv = torch.randn(row + 1, 3 * heads * head_dim) * 2
    in_span = torch.zeros(row + 1, dtype=torch.bool)
    for start, length in zip(starts, lens, strict=True):
        in_span[start : start + length] = True
    qkv[~in_span] = float("nan")
    spans = torch.tensor([starts, lens])
    out = ops.encoder_attention(qkv, spans, heads, head_dim, head_dim**-0.5)
    assert out.shape == (row + 1, heads * head_dim)
    for start, length in zip(starts, lens, strict=True):
        rows = qkv[start : start + length].view(length, 3 * heads, head_dim).transpose(0, 1)
        q, k, v = rows.split(heads)
        expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        got = out[start : start + length].view(length, heads, head_dim).transpose(0, 1)
        torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


def test_encoder_attention_refuses_what_it_cannot_take(ops: NativeOps) -> None:
    qkv = torch.randn(10, 3 * 2 * 12)
    with pytest.raises(ValueError, match="head_dim in multiples of 8"):
        ops.encoder_attention(qkv, torch.tensor([[0], [10]]), 2, 12, 0.3)
    qkv = torch.randn(10, 3 * 2 * 8)
    with pytest.raises(ValueError, match="past the 10 rows"):
        ops.encoder_attention(qkv, torch.tensor([[4], [7]]), 2, 8, 0.3)
    with pytest.raises(ValueError, match="spans must be int64"):
        ops.encoder_attention(qkv, torch.tensor([[0.0], [4.0]]), 2, 8, 0.3)


def test_write_cache_stores_strided_rows_at_their_slots(ops: NativeOps) -> None:
    torch.manual_seed(0)
    num_kv_heads, head_dim = 2, 8
    kv_cache = torch.zeros(2, 6, 4, num_kv_heads, head_dim)
    qkv = torch.randn(3, 5, head_dim)  # as the fused projection leaves it: q, q, q, then k, v
    key, value = qkv[:, 3:4].expand(3, 2, head_dim).contiguous(), qkv[:, 3:5]
    slots = torch.tensor([22, 5, 13])
    ops.write_cache(key, value, kv_cache, slots)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[0, slots], key)
    torch.testing.assert_close(flat[1, slots], value)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert flat[:, untouched].abs().sum() == 0


def test_decode_stack_refuses_layers_it_cannot_walk_as_one() -> None:
    def layer(**changes: Any) -> DecodeLayerWeights:
        fields: dict[str, Any] = dict(
            weight_kinds=(WeightKind.F32,) * 4,
            hidden_size=16,
            eps=1e-5,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            scale=0.35,
        )
        fields.update(changes)
        return DecodeLayerWeights(
            norms=(1, 2), linears=(3, 4, 5, 6), intermediate_size=32, **fields
        )

    cache = torch.zeros(2, 3, 4, 2, 8)
    stack = DecodeStack([layer(), layer()], [cache, cache.clone()])
    assert (stack.num_blocks, stack.block_size, len(stack.layers)) == (3, 4, 2)
    assert stack.layers[1].key_cache != stack.layers[0].key_cache
    with pytest.raises(ValueError, match="differ in eps"):
        DecodeStack([layer(), layer(eps=1e-6)], [cache, cache])
    with pytest.raises(ValueError, match="differ in block size"):
        DecodeStack([layer(), layer()], [cache, torch.zeros(2, 3, 8, 2, 8)])
    with pytest.raises(ValueError, match="differ in number of blocks"):
        DecodeStack([layer(), layer()], [cache, torch.zeros(2, 5, 4, 2, 8)])
    with pytest.raises(ValueError, match="heads differ"):
        DecodeStack([layer()], [torch.zeros(2, 3, 4, 1, 16)])
    with pytest.raises(ValueError, match="differ in hidden_size"):
        DecodeStack([layer(), layer(hidden_size=32)], [cache, cache])
    with pytest.raises(ValueError, match="differ in dtype"):
        DecodeStack([layer(), layer()], [cache, cache.bfloat16()])
    with pytest.raises(ValueError, match="differ in norm_kind"):
        DecodeStack([layer(), layer(norm_kind=NormKind.LAYER)], [cache, cache])
    # Scale, window, soft cap, RoPE table, KV group and weight kinds may differ per layer.
    kinds = (WeightKind.QUANT, WeightKind.F32, WeightKind.BF16_DOT, WeightKind.BF16_WIDEN)
    mixed = DecodeStack(
        [
            layer(),
            layer(
                scale=0.1,
                sliding_window=8,
                soft_cap=50.0,
                rope_table=1,
                kv_group=2,
                weight_kinds=kinds,
            ),
        ],
        [cache, cache],
    )
    assert (mixed.num_rope_tables, mixed.num_kv_groups) == (2, 3)
    assert (mixed.layers[1].window, mixed.layers[1].rope_table) == (8, 1)
    assert list(mixed.layers[1].weight_kinds) == [3, 0, 2, 1]
    assert list(mixed.layers[0].weight_kinds) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16"):
        DecodeStack([layer()], [cache.transpose(2, 3)])
    with pytest.raises(ValueError, match="one KV cache per layer"):
        DecodeStack([layer(), layer()], [cache])


def test_write_cache_rounds_into_a_bf16_pool_as_pytorch_does(ops: NativeOps) -> None:
    torch.manual_seed(1)
    num_kv_heads, head_dim = 3, 64
    kv_cache = torch.zeros(2, 5, 4, num_kv_heads, head_dim, dtype=torch.bfloat16)
    key = torch.randn(6, num_kv_heads, head_dim) * 1000
    value = torch.randn(6, num_kv_heads, head_dim)
    # Exact ties between two bf16 neighbours round to the even one; infinities stay.
    key[0, 0, :4] = torch.tensor([1.00390625, 1.01171875, float("inf"), -float("inf")])
    slots = torch.tensor([19, 0, 7, 8, 12, 3])
    ops.write_cache(key, value, kv_cache, slots)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, slots], key.to(torch.bfloat16))
    assert torch.equal(flat[1, slots], value.to(torch.bfloat16))
    nan_key = torch.full((1, num_kv_heads, head_dim), float("nan"))
    ops.write_cache(nan_key, value[:1], kv_cache, torch.tensor([1]))
    assert torch.isnan(flat[0, 1]).all()


@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm_matches_torch(
    ops: NativeOps, num_rows: int, with_residual: bool, with_bias: bool
) -> None:
    torch.manual_seed(num_rows)
    width = 76  # eight-lane passes and a remainder
    x, residual = torch.randn(num_rows, width) * 3 + 1, torch.randn(num_rows, width)
    weight, bias = torch.randn(width), torch.randn(width) if with_bias else None
    stream = residual.clone()
    out = ops.add_layer_norm(x, stream if with_residual else None, weight, bias, 1e-5)
    source = residual + x if with_residual else x
    expected = F.layer_norm(source, (width,), weight, bias, 1e-5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if with_residual:
        torch.testing.assert_close(stream, residual + x)


def test_head_rms_norm_normalises_each_head_in_place(ops: NativeOps) -> None:
    torch.manual_seed(0)
    rows = torch.randn(7, 5 * 24 + 10)  # five heads of 24 at the start of each row, then more
    weight = torch.randn(24)
    heads = rows[:, : 5 * 24].view(7, 5, 24)
    expected = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    rest = rows[:, 5 * 24 :].clone()
    ops.head_rms_norm_(heads, weight, 1e-6)
    torch.testing.assert_close(heads, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(rows[:, 5 * 24 :], rest)


@pytest.mark.parametrize("gated", [False, True])
def test_gelu_tanh_matches_torch_including_large_inputs(ops: NativeOps, gated: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 2 * 45 if gated else 45) * 4
    x[0, :6] = torch.tensor([-100.0, -20.0, -1e-4, 0.0, 1e-4, 50.0])
    out = ops.gelu_tanh(x, gated)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        expected = F.gelu(gate, approximate="tanh") * up
    else:
        expected = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
