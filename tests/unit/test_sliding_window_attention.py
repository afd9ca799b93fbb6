"""Sliding-window and soft-capped attention in every backend, against attention written out.

The reference attends each query token over its request's whole K/V history,
held in plain tensors, keeping the keys at ``p - window < k <= p`` and
squashing scores through ``cap * tanh(score / cap)``. The backends read the
paged pool instead, through block tables whose entries wholly before every
query's window hold the null block, as the hybrid KV cache leaves them once
it has handed those blocks back: those entries must get no weight. Where a
backend skips them outright (the C kernel, the prefill gather) the null block
holds NaN here, so that reading it would show.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from kvserve.attention import (
    AttentionLayout,
    NativePagedAttention,
    PrefillChunk,
    TorchPagedAttention,
)
from kvserve.attention import masks as visibility
from kvserve.kernels import NativeOps

BLOCK_SIZE = 8


@dataclass
class Case:
    """A step: per request (tokens computed before, tokens this step), flat-batch order."""

    requests: list[tuple[int, int]]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16


def reference(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    requests: list[tuple[int, int]],
    scale: float,
    window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """query ``[T, Hq, D]``; keys/values[r]: request r's whole history ``[L, Hkv, D]``."""
    out = torch.empty_like(query)
    row = 0
    for (context, new), k_all, v_all in zip(requests, keys, values, strict=True):
        group = query.shape[1] // k_all.shape[1]
        k_rep = k_all.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v_rep = v_all.repeat_interleave(group, dim=1)
        for i in range(new):
            p = context + i
            lo = 0 if window is None else max(0, p - window + 1)
            scores = torch.einsum("hd,khd->hk", query[row], k_rep[lo : p + 1]) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            weights = torch.softmax(scores, dim=-1)
            out[row] = torch.einsum("hk,khd->hd", weights, v_rep[lo : p + 1])
            row += 1
    return out


def build_step(case: Case, window: int | None, null_value: float, pool_dtype: torch.dtype):
    """Pool, fresh K/V, metadata and per-request histories for one step of ``case``."""
    hkv, dim = case.num_kv_heads, case.head_dim
    lengths = [context + new for context, new in case.requests]
    widths = [math.ceil(length / BLOCK_SIZE) for length in lengths]
    num_blocks = sum(widths) + 1
    pool = torch.randn(2, num_blocks, BLOCK_SIZE, hkv, dim).to(pool_dtype)
    pool[:, 0] = null_value
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, keys, values, fresh_k, fresh_v, slots = [], [], [], [], [], []
    for (context, new), width in zip(case.requests, widths, strict=True):
        table = [ids.pop() for _ in range(width)]
        history_k = torch.randn(context + new, hkv, dim).to(pool_dtype).float()
        history_v = torch.randn(context + new, hkv, dim).to(pool_dtype).float()
        for pos in range(context):  # the context is in the pool already
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            pool[0, block, offset] = history_k[pos].to(pool_dtype)
            pool[1, block, offset] = history_v[pos].to(pool_dtype)
        fresh_k.append(history_k[context:])
        fresh_v.append(history_v[context:])
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(context, context + new)
        ]
        if window is not None:  # what the hybrid cache has handed back by now
            for j in range(width):
                if (j + 1) * BLOCK_SIZE - 1 < context - window + 1:
                    table[j] = 0
        tables.append(table)
        keys.append(history_k)
        values.append(history_v)
    num_decodes = sum(1 for _, new in case.requests if new == 1)
    assert all(new == 1 for _, new in case.requests[:num_decodes])
    decode_width = max(widths[:num_decodes], default=0)
    decode_tables = torch.zeros(num_decodes, decode_width, dtype=torch.long)
    for row in range(num_decodes):
        decode_tables[row, : widths[row]] = torch.tensor(tables[row])
    prefills, start = [], num_decodes
    for row in range(num_decodes, len(case.requests)):
        context, new = case.requests[row]
        prefills.append(PrefillChunk(start, new, context, torch.tensor(tables[row])))
        start += new
    layout = AttentionLayout(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=num_decodes,
        decode_block_tables=decode_tables,
        decode_seq_lens=torch.tensor(lengths[:num_decodes], dtype=torch.long),
        prefills=tuple(prefills),
        block_size=BLOCK_SIZE,
        sliding_window=window,
    )
    return pool, torch.cat(fresh_k), torch.cat(fresh_v), layout, keys, values


CASES = [
    # Decodes of every length against the window, and chunks: one starting the
    # sequence longer than the window, one after a long context, one short.
    Case([(0, 1), (6, 1), (32, 1), (69, 1), (129, 1), (0, 50), (37, 20), (100, 3)]),
    Case([(15, 1), (300, 1), (0, 90)], num_heads=4, num_kv_heads=1, head_dim=256),  # Gemma 3
    Case([(8, 1), (40, 1), (64, 17)], num_heads=3, num_kv_heads=3, head_dim=8),
]


@pytest.mark.parametrize("case", CASES, ids=["mixed", "gemma3-heads", "no-grouping"])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("backend_name", ["torch_paged", "native_paged"])
def test_backends_attend_within_the_window(
    ops: NativeOps,
    case: Case,
    window: int | None,
    soft_cap: float | None,
    backend_name: str,
) -> None:
    torch.manual_seed(7)
    native = backend_name == "native_paged"
    # The PyTorch decode reads its whole rectangle under a mask: its null block is zeros,
    # as the real pool's is. The kernel and the chunk gather skip the handed-back blocks.
    null_value = math.nan if native else 0.0
    pool, key, value, layout, keys, values = build_step(case, window, null_value, torch.float32)
    num_tokens = key.shape[0]
    query = torch.randn(num_tokens, case.num_heads, case.head_dim) * 2
    scale = case.head_dim**-0.5
    backend = NativePagedAttention(ops) if native else TorchPagedAttention()
    md = backend.build_group(layout, torch.float32, pool.shape[1])
    actual = backend.forward(query, key, value, pool, md, scale, soft_cap)
    expected = reference(query, keys, values, case.requests, scale, window, soft_cap)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [3, 64, 100, 999, 1000, 5000])
def test_kernel_splits_long_windowed_rows_across_threads(
    ops: NativeOps,
    num_threads: int,
    pool_dtype: torch.dtype,
    window: int,
) -> None:
    # A long row is split across threads from the window's first block on; every split
    # must agree with the reference, and the handed-back blocks (NaN) stay unread.
    torch.manual_seed(window)
    case = Case([(999, 1), (120, 1)], num_heads=9, num_kv_heads=3, head_dim=64)
    pool, key, value, layout, keys, values = build_step(case, window, math.nan, pool_dtype)
    query = torch.randn(2, 9, 64)
    ops.write_cache(key, value, pool, layout.slot_mapping)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        actual = ops.paged_decode(
            query, pool, layout.decode_block_tables, layout.decode_seq_lens, 0.125, window, 5.0
        )
    finally:
        torch.set_num_threads(threads)
    if ops.pool_kind(pool_dtype) == 2:
        # The AVX512-BF16 loops round the query and the softmax weights to bf16: each
        # weight is off by at most 2^-9 of itself, which attention over |V| bounds (see
        # test_native_kernels.assert_within_bf16_weight_rounding).
        rounded = query.to(torch.bfloat16).float()
        expected = reference(rounded, keys, values, case.requests, 0.125, window, 5.0)
        magnitudes = [v.abs() for v in values]
        bound = reference(rounded, keys, magnitudes, case.requests, 0.125, window, 5.0) * 2**-8
        assert ((actual - expected).abs() <= bound + 1e-5).all()
    else:
        expected = reference(query, keys, values, case.requests, 0.125, window, 5.0)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_windowed_masks_are_built_once_per_step_and_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool, key, value, layout, _, _ = build_step(Case([(20, 1), (30, 5)]), 4, 0.0, torch.float32)
    full = dataclasses.replace(layout, sliding_window=None)  # a global group of the same step
    backend = TorchPagedAttention()
    windowed_md, full_md = backend.build_metadata(
        (layout, full), torch.float32, pool.shape[1]
    ).groups

    def built_again(*args: object) -> None:
        raise AssertionError("a layer built a mask the step had built")

    monkeypatch.setattr(visibility, "decode_mask", built_again)
    monkeypatch.setattr(visibility, "chunk_mask", built_again)
    query = torch.randn(key.shape[0], 4, 16)
    for md in (windowed_md, full_md, windowed_md):  # the step's later layers reuse them
        backend.forward(query, key, value, pool, md, 0.25)
    decode_mask = windowed_md.decode_mask
    assert decode_mask is not None
    visible = (decode_mask[0, 0, 0] == 0).nonzero().flatten().tolist()
    assert visible == [17, 18, 19, 20]  # the last four of 21 tokens


@pytest.mark.parametrize(("window", "cap"), [(0, None), (-3, None), (None, 0.0), (None, -1.0)])
def test_kernel_refuses_bad_window_or_cap(
    ops: NativeOps,
    window: int | None,
    cap: float | None,
) -> None:
    pool, _, _, layout, _, _ = build_step(Case([(5, 1)]), None, 0.0, torch.float32)
    query = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match=r"sliding_window|soft_cap"):
        ops.paged_decode(
            query, pool, layout.decode_block_tables, layout.decode_seq_lens, 0.25, window, cap
        )
