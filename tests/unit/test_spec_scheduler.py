"""The scheduler with speculative proposals, against the same scheduler without them.

A fake model whose next token depends only on the position (a repeating
pattern with occasional surprises, so that some proposals are rejected)
makes any correct scheduler produce the same tokens with and without
speculation; only the number of steps may differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.core.block_hash import extend_block_hashes
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.sampling_params import SamplingParams

PATTERN = [11, 12, 13, 14, 15, 16, 17]
BLOCK_SIZE = 4


def truth(position: int) -> int:
    """The token the fake model puts at ``position``."""
    return 99 if position % 13 == 0 else PATTERN[position % len(PATTERN)]


def make_scheduler(
    speculative: bool,
    num_blocks: int = 200,
    budget: int = 64,
    max_num_seqs: int = 8,
    caching: bool = True,
    k: int = 4,
) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1) if speculative else None
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching)
    return Scheduler(config, kv, max_model_len=4096, speculative_config=spec)


def make_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    prompt = [truth(p) for p in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    sampled: dict[str, int] = {}
    verified: dict[str, list[int]] = {}
    for item in output.scheduled:
        request = item.request
        if item.spec_token_ids:
            # Never more proposals than could be kept within max_tokens.
            remaining = request.sampling_params.max_tokens - request.num_output_tokens
            assert len(item.spec_token_ids) <= remaining - 1
            start = request.num_computed_tokens  # the last known token's position
            emitted = []
            for j, proposal in enumerate([*item.spec_token_ids, None]):
                emitted.append(truth(start + 1 + j))
                if proposal != emitted[-1]:
                    break
            verified[request.request_id] = emitted
        elif item.samples:
            sampled[request.request_id] = truth(request.num_tokens)
    return output, scheduler.update_from_output(output, sampled, verified)


def run_all(scheduler: Scheduler, requests: list[Request]) -> int:
    for request in requests:
        scheduler.add_request(request)
    kv = scheduler.kv_cache_manager
    steps = 0
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler)
        steps += 1
        assert output.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        for request in scheduler.running:  # no block past the known tokens is kept
            assert kv.num_held_blocks(request.request_id) <= cdiv(request.num_tokens, BLOCK_SIZE)
        assert steps < 10_000
    assert kv.num_free_blocks == kv.num_usable_blocks
    return steps


def test_outputs_match_and_fewer_steps_run() -> None:
    def requests() -> list[Request]:
        return [make_request(f"r{i}", 9 + 5 * i, 20 + 3 * i) for i in range(6)]

    plain, speculative = requests(), requests()
    plain_steps = run_all(make_scheduler(False), plain)
    scheduler = make_scheduler(True)
    spec_steps = run_all(scheduler, speculative)
    for want, got in zip(plain, speculative, strict=True):
        assert got.output_token_ids == want.output_token_ids
    assert spec_steps < plain_steps
    assert 0 < scheduler.num_spec_accepted_total < scheduler.num_spec_proposed_total


def test_cached_blocks_hold_only_kept_tokens() -> None:
    scheduler = make_scheduler(True)
    requests = [make_request(f"r{i}", 9 + 2 * i, 30) for i in range(4)]
    run_all(scheduler, requests)
    kept: set[object] = set()
    for request in requests:
        hashes: list[object] = []
        extend_block_hashes(hashes, request.all_token_ids, BLOCK_SIZE, None)  # type: ignore[arg-type]
        kept.update(hashes)
    cached = scheduler.kv_cache_manager.block_pool.cached_block_hashes()
    assert cached and cached <= kept


def test_proposals_never_take_a_decodes_token() -> None:
    """Every decoding request is scheduled each step; proposals get only what is left."""
    scheduler = make_scheduler(True, budget=6, max_num_seqs=4)
    requests = [make_request(f"r{i}", 2, 30) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    saw_proposals = False
    while scheduler.has_unfinished_requests():
        decoding = {
            r.request_id for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1
        }
        output, _ = run_step(scheduler)
        assert decoding <= {item.request.request_id for item in output.scheduled}
        saw_proposals = saw_proposals or any(item.spec_token_ids for item in output.scheduled)
    assert saw_proposals  # the 2 tokens left over did go to proposals


def test_proposals_are_dropped_rather_than_preempting() -> None:
    # Two usable blocks: the 7-token prompt and its first outputs fit, proposals past
    # position 7 would need a third block.
    scheduler = make_scheduler(True, num_blocks=3, caching=False)
    assert scheduler.kv_cache_manager.num_usable_blocks == 2
    request = make_request("r", 7, 2)
    scheduler.add_request(request)
    run_step(scheduler)  # the prompt
    output, finished = run_step(scheduler)
    assert output.scheduled[0].spec_token_ids == []  # max_tokens leaves room for none anyway
    assert finished == [request] and scheduler.num_preemptions_total == 0

    scheduler = make_scheduler(True, num_blocks=3, caching=False)
    request = make_request("r", 7, 8)
    scheduler.add_request(request)
    run_step(scheduler)
    output, _ = run_step(scheduler)
    (item,) = output.scheduled
    assert item.spec_token_ids == [] and item.num_new_tokens == 1
    assert scheduler.num_preemptions_total == 0


def test_proposals_stop_at_max_tokens() -> None:
    scheduler = make_scheduler(True, k=8)
    request = make_request("r", 20, 4)
    scheduler.add_request(request)
    run_step(scheduler)  # prompt and first token
    output, _ = run_step(scheduler)
    (item,) = output.scheduled
    assert len(item.spec_token_ids) == 2  # 1 generated, 1 to verify now, 2 proposals: 4 in all
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert request.num_output_tokens == 4
    assert request.output_token_ids == [truth(p) for p in range(20, 24)]


class OracleProposer:
    """A proposer handed to the scheduler (as the engine hands the draft model's): proposes
    the fake model's own tokens, and records what the scheduler tells it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.finished: dict[str, list[int]] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        self.calls.append((request_id, len(token_ids), num_tokens))
        return [truth(len(token_ids) + j) for j in range(num_tokens)]

    def finish_request(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        self.finished[request_id] = list(output_token_ids)

    def forget_outputs(self) -> None:
        self.finished.clear()


def test_a_proposer_passed_in_is_asked_and_told_of_every_finish() -> None:
    proposer = OracleProposer()
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    kv = KVCacheManager(200, BLOCK_SIZE, enable_caching=True)
    spec = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    scheduler = Scheduler(config, kv, 4096, spec, proposer)
    assert scheduler.proposer is proposer
    requests = [make_request(f"r{i}", 6 + 3 * i, 17) for i in range(3)]
    run_all(scheduler, requests)
    # Perfect guesses: every proposal kept, within max_tokens.
    assert scheduler.num_spec_accepted_total == scheduler.num_spec_proposed_total > 0
    assert {request_id for request_id, _, _ in proposer.calls} == {"r0", "r1", "r2"}
    assert all(1 <= k <= 3 for _, _, k in proposer.calls)
    assert proposer.finished == {r.request_id: r.output_token_ids for r in requests}
    for request in requests:
        assert request.output_token_ids == [
            truth(p) for p in range(request.num_prompt_tokens, request.num_tokens)
        ]


def test_a_proposer_without_a_config_is_refused() -> None:
    config = SchedulerConfig()
    with pytest.raises(ValueError, match="needs a speculative_config"):
        Scheduler(config, KVCacheManager(10, BLOCK_SIZE), 4096, None, OracleProposer())
    spec = SpeculativeConfig(method="draft_model", model="some-draft")
    with pytest.raises(ValueError, match="the engine builds it"):
        Scheduler(config, KVCacheManager(10, BLOCK_SIZE), 4096, spec)
