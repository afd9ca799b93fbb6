"""A request verifying speculative proposals is laid out as decode rows, one per token."""

from __future__ import annotations

import torch

from kvserve.attention import TorchPagedAttention
from kvserve.core.block_pool import NULL_BLOCK_ID as NULL
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import prepare_inputs

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def request(request_id: str, num_tokens: int, num_computed: int) -> Request:
    made = Request(request_id, list(range(num_tokens)), SamplingParams())
    made.num_computed_tokens = num_computed
    return made


def test_verifying_rows_are_decode_rows_between_decodes_and_chunks() -> None:
    # Listed chunk first, then the verification, then the decode; tables per group
    # (global, then a window of 4 whose blocks before the window are null).
    chunk = ScheduledRequest(request("chunk", 6, 0), 6, ([3, 4], [13, 14]), samples=True)
    # 7 tokens, 6 computed: its last known token (position 6), then two proposals.
    verify = ScheduledRequest(
        request("verify", 7, 6),
        3,
        ([5, 6, 10], [NULL, 16, 20]),
        samples=True,
        spec_token_ids=[100, 101],
    )
    decode = ScheduledRequest(request("decode", 10, 9), 1, ([7, 8, 9], [NULL, 18, 19]), True)
    inputs = prepare_inputs([chunk, verify, decode], BLOCK_SIZE, CPU, sliding_windows=(None, 4))

    assert [s.request.request_id for s in inputs.scheduled] == ["decode", "verify", "chunk"]
    assert inputs.input_ids.tolist() == [9, 6, 100, 101, 0, 1, 2, 3, 4, 5]
    assert inputs.positions.tolist() == [9, 6, 7, 8, 0, 1, 2, 3, 4, 5]
    # The decode's last row, the verification's three, the chunk's last.
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 9]
    assert [r.request_id for r in inputs.sampling_requests] == ["decode", "verify", "chunk"]
    assert inputs.spec_token_ids == [[], [100, 101], []]

    full, sliding = inputs.attn_layouts
    # Slot = block * 4 + offset: position 9 in block 9 // 4 = 2 of the decode's table, ...
    assert full.slot_mapping.tolist() == [37, 26, 27, 40, 12, 13, 14, 15, 16, 17]
    assert sliding.slot_mapping.tolist() == [77, 66, 67, 80, 52, 53, 54, 55, 56, 57]
    for layout, decode_table, verify_table in (
        (full, [7, 8, 9], [5, 6, 10]),
        (sliding, [NULL, 18, 19], [NULL, 16, 20]),
    ):
        assert layout.num_decode_tokens == 4
        # Row i of the verification sees its context (6) plus i + 1 tokens.
        assert layout.decode_seq_lens.tolist() == [10, 7, 8, 9]
        assert layout.decode_block_tables.tolist() == [decode_table] + [verify_table] * 3
        [prefill] = layout.prefills
        assert (prefill.query_start, prefill.query_len, prefill.context_len) == (4, 6, 0)
    assert full.prefills[0].block_table.tolist() == [3, 4]
    assert sliding.prefills[0].block_table.tolist() == [13, 14]


def test_decode_rows_attend_as_the_chunk_they_replace() -> None:
    """PyTorch's paged attention over the verification's decode rows equals causal
    attention over the request's whole sequence, computed here without the pool."""
    torch.manual_seed(0)
    num_heads, head_dim, num_blocks = 2, 8, 12
    table = [5, 2, 9]  # positions 0..11; 6 computed, then 1 + 2 rows
    item = ScheduledRequest(
        request("verify", 7, 6), 3, (table,), samples=True, spec_token_ids=[100, 101]
    )
    inputs = prepare_inputs([item], BLOCK_SIZE, CPU, sliding_windows=(None,))
    assert not inputs.attn_layouts[0].prefills  # a decode-only step
    keys, values = torch.randn(2, 9, num_heads, head_dim).unbind(0)
    queries = torch.randn(9, num_heads, head_dim)
    kv_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_heads, head_dim)
    for position in range(6):  # the cached context
        slot = table[position // BLOCK_SIZE], position % BLOCK_SIZE
        kv_cache[0][slot], kv_cache[1][slot] = keys[position], values[position]
    backend = TorchPagedAttention()
    metadata = backend.build_metadata(inputs.attn_layouts, torch.float32, num_blocks)
    scale = head_dim**-0.5
    out = backend.forward(queries[6:], keys[6:], values[6:], kv_cache, metadata.groups[0], scale)
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), is_causal=True
    ).transpose(0, 1)[6:]
    torch.testing.assert_close(out, expected)
