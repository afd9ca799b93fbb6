"""Turn a step's schedule into the flat tensors of one forward pass.

Requests with a single new token (decodes, or the last token of a prompt) go
first, then requests verifying speculative proposals, then prefill chunks;
within each group the scheduler's order is kept.
The per-token arrays (positions, slot mapping) are computed with numpy in one
go; the only Python loop is over requests. A model with several KV cache
groups gets one slot mapping and one set of block tables per group (each
group writes its layers' K/V into its own blocks); positions, token ids and
logits indices are shared.

A request verifying speculative proposals has ``1 + k`` tokens (its last known
token, then the proposals) and logits at each of those rows. The attention
layouts list them as ``1 + k`` decode rows rather than one chunk: row i sees
the request's block table up to its own position (``seq_len`` = computed
tokens + 1 + i). Every backend writes all of a layer's K/V into the pool
before it attends, so row i reads the proposals before it from the pool, as a
causal chunk would; and a step whose only multi-token requests are
verifications stays decode-only, so it takes the decode fast path (the CPU's
one-call decoder, CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention import AttentionLayout, PrefillChunk
from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.request import Request
from kvserve.core.scheduler import ScheduledRequest


@dataclass(frozen=True)
class ModelInputs:
    """Everything one forward pass and its sampling need.

    input_ids, positions: ``[num_tokens]`` long.
    attn_layouts: one attention layout per KV cache group, in group order.
    logits_indices: ``[num_logits]`` long; the flat-batch rows whose hidden
        states go through the LM head, in the order of ``sampling_requests``
        (a request verifying k proposals has k + 1 consecutive ones).
    scheduled: the step's requests in flat-batch order (single-token ones first,
        then verifying ones, then prefill chunks).
    prompt_logprob_rows: the flat-batch rows whose logits give prompt logprobs,
        one run per request that asks (empty when none does).
    spec_token_ids: per sampling request, the proposals it verifies (often
        none); None when no request of the step verifies any.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_layouts: tuple[AttentionLayout, ...]
    logits_indices: torch.Tensor
    sampling_requests: list[Request]
    scheduled: list[ScheduledRequest]
    prompt_logprob_rows: tuple[PromptLogprobRows, ...] = ()
    spec_token_ids: list[list[int]] | None = None


@dataclass(frozen=True)
class PromptLogprobRows:
    """A run of one request's prompt positions whose logits this step computes.

    The hidden state at flat row ``first_row + i`` (prompt position
    ``first_position + i``) predicts prompt token ``first_position + i + 1``,
    which is ``target_token_ids[i]``. The prompt's last position is never in a
    run: it predicts the first generated token, and is sampled as usual.
    """

    request_id: str
    num_top: int
    first_row: int
    first_position: int
    target_token_ids: list[int]


def prepare_inputs(
    scheduled: Sequence[ScheduledRequest],
    block_size: int,
    device: torch.device,
    sliding_windows: Sequence[int | None],
) -> ModelInputs:
    """Build the model inputs for ``scheduled`` (which must not be empty).

    sliding_windows: each KV cache group's window (None: global), in the
    order of ``ScheduledRequest.block_ids`` (``ModelRunner.sliding_windows``).
    The layouts are where the attention backends read each group's window:
    there is no default, since a wrong one attends over the wrong keys.

    The attention layouts are the ones every backend shares; the runner has
    the backend build what it needs from them (``AttentionBackend.build_metadata``).
    """
    singles = [s for s in scheduled if s.num_new_tokens == 1]
    verifying = [s for s in scheduled if s.num_new_tokens > 1 and s.spec_token_ids]
    chunks = [s for s in scheduled if s.num_new_tokens > 1 and not s.spec_token_ids]
    items = singles + verifying + chunks
    num_groups = len(items[0].block_ids)
    windows = tuple(sliding_windows)
    if len(windows) != num_groups or any(len(s.block_ids) != num_groups for s in items):
        raise ValueError(
            f"every scheduled request needs one block table per KV cache group ({len(windows)})"
        )
    if len(singles) == len(items) and all(
        not s.spec_token_ids and s.request.num_prompt_logprobs is None for s in items
    ):
        return _decode_inputs(items, block_size, device, windows)
    num_new = np.array([s.num_new_tokens for s in items], dtype=np.int64)
    context_lens = np.array([s.request.num_computed_tokens for s in items], dtype=np.int64)
    query_end = np.cumsum(num_new)
    query_start = query_end - num_new
    num_tokens = int(query_end[-1])

    # Token i of request r sits at position context_lens[r] + (i - query_start[r]).
    row_of_token = np.repeat(np.arange(len(items)), num_new)
    positions = np.arange(num_tokens) - query_start[row_of_token] + context_lens[row_of_token]
    num_decode_requests = len(singles) + len(verifying)
    batch = _FlatBatch(
        num_decode_requests=num_decode_requests,
        num_decode_tokens=int(query_end[num_decode_requests - 1]) if num_decode_requests else 0,
        num_new=num_new,
        context_lens=context_lens,
        query_start=query_start,
        row_of_token=row_of_token,
        positions=positions,
        block_size=block_size,
        device=device,
    )
    layouts = tuple(
        _group_layout(batch, [item.block_ids[group] for item in items], window)
        for group, window in enumerate(windows)
    )
    input_ids: list[int] = []
    asking_rows = []  # rows of requests that want prompt logprobs (rarely any)
    speculative = False
    for row, item in enumerate(items):
        start = item.request.num_computed_tokens
        if item.spec_token_ids:
            speculative = True
            input_ids.extend(item.request.all_token_ids[start : start + 1])
            input_ids.extend(item.spec_token_ids)
        else:
            input_ids.extend(item.request.all_token_ids[start : start + item.num_new_tokens])
        if item.request.num_prompt_logprobs is not None:
            asking_rows.append(row)
    sampling_rows = [row for row, item in enumerate(items) if item.samples]
    logits_indices = query_end[sampling_rows] - 1
    spec_token_ids = None
    if speculative:
        spec_token_ids = [items[row].spec_token_ids for row in sampling_rows]
        # Each verifying request's rows: its last known token's, then each proposal's.
        logits_indices = np.concatenate(
            [
                np.arange(end - len(spec), end + 1)
                for end, spec in zip(logits_indices, spec_token_ids, strict=True)
            ]
        )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(positions).to(device),
        attn_layouts=layouts,
        logits_indices=torch.from_numpy(logits_indices).to(device),
        sampling_requests=[items[row].request for row in sampling_rows],
        scheduled=items,
        prompt_logprob_rows=_prompt_logprob_rows(items, asking_rows, query_start)
        if asking_rows
        else (),
        spec_token_ids=spec_token_ids,
    )


def _decode_inputs(
    items: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
    windows: tuple[int | None, ...],
) -> ModelInputs:
    """:func:`prepare_inputs` for a step of one new token per request and nothing else
    (plain decode, the most common step): the same inputs, built from short Python lists.
    At one sequence the general path's numpy calls took ~285 us of a 10 ms step (its
    data is cold after the weights stream through the caches), this one ~180 us."""
    positions = [s.request.num_computed_tokens for s in items]
    input_ids = [s.request.all_token_ids[p] for s, p in zip(items, positions, strict=True)]
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)
    num_blocks = -(-(max(positions) + 1) // block_size)
    layouts = []
    for group, window in enumerate(windows):
        tables = [s.block_ids[group] for s in items]
        width = max(map(len, tables))
        padded = [[*t, *[NULL_BLOCK_ID] * (width - len(t))] for t in tables]
        slots = [
            t[p // block_size] * block_size + p % block_size
            for t, p in zip(tables, positions, strict=True)
        ]
        layouts.append(
            AttentionLayout(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                num_decode_tokens=len(items),
                decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device)[
                    :, :num_blocks
                ],
                decode_seq_lens=positions_t + 1,
                prefills=(),
                block_size=block_size,
                sliding_window=window,
            )
        )
    sampling_rows = [row for row, item in enumerate(items) if item.samples]
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=positions_t,
        attn_layouts=tuple(layouts),
        logits_indices=torch.tensor(sampling_rows, dtype=torch.long, device=device),
        sampling_requests=[items[row].request for row in sampling_rows],
        scheduled=items,
    )


def _prompt_logprob_rows(
    items: list[ScheduledRequest], rows: list[int], query_start: np.ndarray
) -> tuple[PromptLogprobRows, ...]:
    """The runs of prompt positions whose logprobs the requests of ``rows`` asked for.

    A chunk covers positions ``[start, start + num_new)``; of those, the ones
    before the prompt's last position are taken (after a preemption a request
    computes its prompt again and gets the same values; the engine keeps the first).
    """
    runs = []
    for row in rows:
        item = items[row]
        request = item.request
        assert request.num_prompt_logprobs is not None
        start = request.num_computed_tokens
        end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
        if end <= start:
            continue
        runs.append(
            PromptLogprobRows(
                request_id=request.request_id,
                num_top=request.num_prompt_logprobs,
                first_row=int(query_start[row]),
                first_position=start,
                target_token_ids=request.prompt_token_ids[start + 1 : end + 1],
            )
        )
    return tuple(runs)


@dataclass(frozen=True)
class _FlatBatch:
    """What every group's layout shares: per-request arrays (``[num_requests]``) and
    per-token ones (``[num_tokens]``: ``row_of_token``, ``positions``), all int64.

    The first ``num_decode_requests`` requests (single tokens, then verifications)
    are decode rows, their ``num_decode_tokens`` tokens one row each.
    """

    num_decode_requests: int
    num_decode_tokens: int
    num_new: np.ndarray
    context_lens: np.ndarray
    query_start: np.ndarray
    row_of_token: np.ndarray
    positions: np.ndarray
    block_size: int
    device: torch.device


def _group_layout(
    batch: _FlatBatch, tables: list[list[int]], sliding_window: int | None
) -> AttentionLayout:
    """One KV cache group's slot mapping and block tables (one table per request, and
    one per decode row: a verifying request's rows repeat its table)."""
    block_size = batch.block_size
    num_decode_requests, num_decode_tokens = batch.num_decode_requests, batch.num_decode_tokens
    block_tables = np.full((len(tables), max(map(len, tables))), NULL_BLOCK_ID, dtype=np.int64)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = table
    positions = batch.positions
    slot_mapping = (
        block_tables[batch.row_of_token, positions // block_size] * block_size
        + positions % block_size
    )
    block_tables_t = torch.from_numpy(block_tables).to(batch.device)
    seq_lens = batch.context_lens + batch.num_new
    prefills = tuple(
        PrefillChunk(
            query_start=int(batch.query_start[row]),
            query_len=int(batch.num_new[row]),
            context_len=int(batch.context_lens[row]),
            block_table=block_tables_t[row, : -(-int(seq_lens[row]) // block_size)],
        )
        for row in range(num_decode_requests, len(tables))
    )
    # A decode row sees the keys up to its own position: a verifying request's row i
    # (its last known token, then proposal i) has the request's context plus i + 1 keys.
    decode_seq_lens = positions[:num_decode_tokens] + 1
    decode_requests = batch.row_of_token[:num_decode_tokens]
    # Decodes attend over a rectangle of whole blocks, as wide as the longest of them.
    num_decode_blocks = -(-int(decode_seq_lens.max()) // block_size) if num_decode_tokens else 0
    if num_decode_tokens == num_decode_requests:  # one row per request: no copy of the tables
        decode_block_tables = block_tables_t[:num_decode_tokens, :num_decode_blocks]
    else:
        decode_block_tables = torch.from_numpy(
            np.ascontiguousarray(block_tables[decode_requests, :num_decode_blocks])
        ).to(batch.device)
    return AttentionLayout(
        slot_mapping=torch.from_numpy(slot_mapping).to(batch.device),
        num_decode_tokens=num_decode_tokens,
        decode_block_tables=decode_block_tables,
        decode_seq_lens=torch.from_numpy(decode_seq_lens).to(batch.device),
        prefills=prefills,
        block_size=block_size,
        sliding_window=sliding_window,
    )
