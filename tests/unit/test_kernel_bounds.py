"""The kernel wrappers refuse indices the C code would follow out of its buffers.

Each case builds valid inputs for one kernel, breaks one thing (a zero length,
a block id or slot past the pool, a length past the table, a dtype, a layout,
a shape) and calls the wrapper. The call runs in a separate process: were a
check missing, the kernel could crash (a zero length divides by zero, a wild
block id reads unmapped memory), and that must fail the case, not end pytest.
The cases share one worker process (started once: importing PyTorch is the
slow part); a crash breaks the worker, fails the case and the next case gets
a fresh one.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch

from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.decode_stack import DecodeLayerWeights, DecodeStack
from kvserve.kernels.weight_kind import WeightKind

NUM_BLOCKS, BLOCK_SIZE = 8, 4
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = 16, 2, 1, 8, 32
NUM_SEQS, TABLE_WIDTH = 3, 3
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE


def valid_inputs() -> dict[str, torch.Tensor]:
    """A decode step of three sequences over a pool of eight blocks; every kernel accepts it."""
    torch.manual_seed(0)
    return {
        "kv_cache": torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
        "query": torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM),
        "key": torch.randn(NUM_SEQS, NUM_KV_HEADS, HEAD_DIM),
        "value": torch.randn(NUM_SEQS, NUM_KV_HEADS, HEAD_DIM),
        # Row 1 uses one block; its other entries are padding with the null block 0.
        "block_tables": torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 7]]),
        "seq_lens": torch.tensor([9, 2, 12]),
        "slot_mapping": torch.tensor([3 * BLOCK_SIZE, 4 * BLOCK_SIZE + 1, 7 * BLOCK_SIZE + 3]),
        "hidden": torch.randn(NUM_SEQS, HIDDEN),
        "rope": torch.randn(NUM_SEQS, 2, HEAD_DIM),
    }


# What each case changes in the valid inputs.
BREAKS: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
    "valid": lambda t: None,
    "unused_entries_out_of_range": lambda t: t["block_tables"][1, 1:].fill_(-1),
    "zero_seq_len": lambda t: t["seq_lens"].__setitem__(1, 0),
    "negative_seq_len": lambda t: t["seq_lens"].__setitem__(0, -5),
    "seq_len_past_table": lambda t: t["seq_lens"].__setitem__(2, TABLE_WIDTH * BLOCK_SIZE + 1),
    "negative_block_id": lambda t: t["block_tables"].__setitem__((0, 1), -1),
    "block_id_past_pool": lambda t: t["block_tables"].__setitem__((2, 2), NUM_BLOCKS),
    "slot_past_pool": lambda t: t["slot_mapping"].__setitem__(1, NUM_SLOTS),
    "negative_slot": lambda t: t["slot_mapping"].__setitem__(0, -1),
    "int32_block_tables": lambda t: t.update(block_tables=t["block_tables"].int()),
    "int32_seq_lens": lambda t: t.update(seq_lens=t["seq_lens"].int()),
    "int32_slot_mapping": lambda t: t.update(slot_mapping=t["slot_mapping"].int()),
    "strided_block_tables": lambda t: t.update(
        block_tables=t["block_tables"].repeat_interleave(2, dim=1)[:, ::2]
    ),
    "strided_slot_mapping": lambda t: t.update(
        slot_mapping=t["slot_mapping"].repeat_interleave(2)[::2]
    ),
    "too_few_seq_lens": lambda t: t.update(seq_lens=t["seq_lens"][:2]),
    "query_head_dim": lambda t: t.update(query=torch.randn(NUM_SEQS, NUM_HEADS, 2 * HEAD_DIM)),
    "float64_query": lambda t: t.update(query=t["query"].double()),
    "key_heads": lambda t: t.update(key=torch.randn(NUM_SEQS, 2, HEAD_DIM)),
    "hidden_width": lambda t: t.update(hidden=torch.randn(NUM_SEQS, 2 * HIDDEN)),
    "rope_head_dim": lambda t: t.update(rope=torch.randn(NUM_SEQS, 2, 2 * HEAD_DIM)),
    "non_contiguous_pool": lambda t: t.update(kv_cache=t["kv_cache"].transpose(1, 2)),
}


def decode_stack(kv_cache: torch.Tensor) -> tuple[DecodeStack, list[torch.Tensor]]:
    """A one-layer stack with random float32 weights (returned too: they must stay alive)."""
    qkv_size = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    weights = [
        torch.ones(HIDDEN),
        torch.ones(HIDDEN),
        torch.randn(qkv_size, HIDDEN) * 0.1,
        torch.randn(HIDDEN, NUM_HEADS * HEAD_DIM) * 0.1,
        torch.randn(2 * INTERMEDIATE, HIDDEN) * 0.1,
        torch.randn(HIDDEN, INTERMEDIATE) * 0.1,
    ]
    pointers = [w.data_ptr() for w in weights]
    layer = DecodeLayerWeights(
        norms=(pointers[0], pointers[1]),
        linears=(pointers[2], pointers[3], pointers[4], pointers[5]),
        weight_kinds=(WeightKind.F32,) * 4,
        hidden_size=HIDDEN,
        eps=1e-5,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        scale=HEAD_DIM**-0.5,
    )
    return DecodeStack([layer], [kv_cache]), weights


def call_kernel(ops: NativeOps, kernel: str, t: dict[str, torch.Tensor]) -> None:
    if kernel == "paged_decode":
        out = ops.paged_decode(t["query"], t["kv_cache"], t["block_tables"], t["seq_lens"], 0.35)
        assert out.shape == (NUM_SEQS, NUM_HEADS, HEAD_DIM) and torch.isfinite(out).all()
    elif kernel == "write_cache":
        ops.write_cache(t["key"], t["value"], t["kv_cache"], t["slot_mapping"])
        flat = t["kv_cache"].view(2, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
        assert torch.equal(flat[0, t["slot_mapping"]], t["key"])
    else:
        stack, _weights = decode_stack(t["kv_cache"])  # holds the pool's address: t keeps it
        out = ops.decode_layers(
            stack, t["hidden"], [t["rope"]], [t["slot_mapping"]], [t["block_tables"]], t["seq_lens"]
        )
        assert torch.isfinite(out).all()


def run_case(kernel: str, case: str) -> str:
    """In the worker: break ``case`` in valid inputs, call ``kernel``, name what it raised."""
    ops = native_ops()
    assert ops is not None
    inputs = valid_inputs()
    BREAKS[case](inputs)
    try:
        call_kernel(ops, kernel, inputs)
    except (IndexError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


# (kernel, case, the exception, a word its message must hold: the argument's name).
CASES = [
    ("paged_decode", "valid", "ok", ""),
    ("paged_decode", "unused_entries_out_of_range", "ok", ""),
    ("paged_decode", "zero_seq_len", "ValueError", "seq_lens"),
    ("paged_decode", "negative_seq_len", "ValueError", "seq_lens"),
    ("paged_decode", "seq_len_past_table", "ValueError", "seq_lens"),
    ("paged_decode", "negative_block_id", "IndexError", "block_tables"),
    ("paged_decode", "block_id_past_pool", "IndexError", "block_tables"),
    ("paged_decode", "int32_block_tables", "ValueError", "block_tables"),
    ("paged_decode", "int32_seq_lens", "ValueError", "seq_lens"),
    ("paged_decode", "strided_block_tables", "ValueError", "block_tables"),
    ("paged_decode", "too_few_seq_lens", "ValueError", "seq_lens"),
    ("paged_decode", "query_head_dim", "ValueError", "query"),
    ("paged_decode", "float64_query", "ValueError", "query"),
    ("paged_decode", "non_contiguous_pool", "ValueError", "kv_cache"),
    ("write_cache", "valid", "ok", ""),
    ("write_cache", "slot_past_pool", "IndexError", "slot_mapping"),
    ("write_cache", "negative_slot", "IndexError", "slot_mapping"),
    ("write_cache", "int32_slot_mapping", "ValueError", "slot_mapping"),
    ("write_cache", "strided_slot_mapping", "ValueError", "slot_mapping"),
    ("write_cache", "key_heads", "ValueError", "key"),
    ("decode_layers", "valid", "ok", ""),
    ("decode_layers", "unused_entries_out_of_range", "ok", ""),
    ("decode_layers", "zero_seq_len", "ValueError", "seq_lens"),
    ("decode_layers", "seq_len_past_table", "ValueError", "seq_lens"),
    ("decode_layers", "block_id_past_pool", "IndexError", "block_tables"),
    ("decode_layers", "negative_block_id", "IndexError", "block_tables"),
    ("decode_layers", "slot_past_pool", "IndexError", "slot_mapping"),
    ("decode_layers", "negative_slot", "IndexError", "slot_mapping"),
    ("decode_layers", "int32_slot_mapping", "ValueError", "slot_mapping"),
    ("decode_layers", "hidden_width", "ValueError", "hidden"),
    ("decode_layers", "rope_head_dim", "ValueError", "rope"),
]


@pytest.fixture(scope="module")
def isolated() -> Iterator[Callable[[str, str], str]]:
    """Runs a case in the worker process; a crash there fails the case."""
    if native_ops() is None:
        pytest.skip("the C kernels could not be built here")
    context = multiprocessing.get_context("spawn")  # never fork a process with OpenMP threads
    pools: list[ProcessPoolExecutor] = []

    def run(kernel: str, case: str) -> str:
        if not pools:
            pools.append(ProcessPoolExecutor(max_workers=1, mp_context=context))
        try:
            return pools[0].submit(run_case, kernel, case).result(timeout=300)
        except BrokenProcessPool:
            pools.pop().shutdown()
            pytest.fail(f"{kernel} with {case} crashed the process instead of raising")

    yield run
    for pool in pools:
        pool.shutdown()


@pytest.mark.parametrize(("kernel", "case", "raised", "names"), CASES)
def test_kernel_refuses_what_it_would_follow_out_of_bounds(
    isolated: Callable[[str, str], str], kernel: str, case: str, raised: str, names: str
) -> None:
    outcome = isolated(kernel, case)
    assert outcome.split(":")[0] == raised, outcome
    assert names in outcome
