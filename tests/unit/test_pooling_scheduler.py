"""Embedding requests in the scheduler: whole prompts in the shared budget, no prefix cache,
finished (blocks freed) in the step that computes them. A fake model: every sampling row
gets token 7; embedding rows sample nothing."""

from __future__ import annotations

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams


def make_scheduler(
    budget: int = 32, prefill_cap: int | None = None, caching: bool = False
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        max_prefill_tokens_while_decoding=prefill_cap,
    )
    return Scheduler(config, KVCacheManager(64, 4, enable_caching=caching), 4096)


def generation(request_id: str, prompt_len: int, max_tokens: int = 8, first: int = 10) -> Request:
    prompt = list(range(first, first + prompt_len))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def embedding(request_id: str, prompt_len: int, first: int = 10) -> Request:
    prompt = list(range(first, first + prompt_len))
    return Request(request_id, prompt, SamplingParams(max_tokens=1), pooling_params=PoolingParams())


def run_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    sampled = {item.request.request_id: 7 for item in output.scheduled if item.samples}
    return output, scheduler.update_from_output(output, sampled)


def test_embedding_runs_whole_in_one_step_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(budget=32)
    scheduler.add_request(embedding("e", 20))
    output, finished = run_step(scheduler)
    (item,) = output.scheduled
    assert item.num_new_tokens == 20 and not item.samples
    assert [r.request_id for r in finished] == ["e"]
    assert finished[0].status == RequestStatus.FINISHED_STOPPED
    assert finished[0].output_token_ids == []
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert not scheduler.has_unfinished_requests()


def test_embedding_is_never_chunked_it_waits_for_room() -> None:
    scheduler = make_scheduler(budget=32)
    scheduler.add_request(generation("g", 20))
    scheduler.add_request(embedding("e", 20))
    output, _ = run_step(scheduler)
    # 12 tokens are left after g's 20: e does not split, it waits for the next step.
    assert {i.request.request_id: i.num_new_tokens for i in output.scheduled} == {"g": 20}
    output, finished = run_step(scheduler)
    assert {i.request.request_id: i.num_new_tokens for i in output.scheduled} == {"g": 1, "e": 20}
    assert [r.request_id for r in finished] == ["e"]


def test_embeddings_batch_together_beside_decodes_past_the_prefill_cap() -> None:
    scheduler = make_scheduler(budget=64, prefill_cap=8)
    scheduler.add_request(generation("g", 4))
    run_step(scheduler)  # g decodes from now on
    for index in range(3):
        scheduler.add_request(embedding(f"e{index}", 12, first=100 * index))
    output, _ = run_step(scheduler)
    # The first embedding may exceed the cap of 8 (or decodes could starve it); the
    # others fit what the cap leaves, which is nothing: they run in the next step.
    assert {i.request.request_id: i.num_new_tokens for i in output.scheduled} == {"g": 1, "e0": 12}
    output, _ = run_step(scheduler)
    assert {i.request.request_id for i in output.scheduled} == {"g", "e1"}


def test_embedding_takes_no_prefix_cache_hit_and_fills_none() -> None:
    scheduler = make_scheduler(budget=64, caching=True)
    scheduler.add_request(generation("g", 16, max_tokens=1))
    run_step(scheduler)
    assert not scheduler.has_unfinished_requests()
    # The same 16 tokens are cached now; an embedding must still compute all of them.
    scheduler.add_request(embedding("e", 16))
    output, _ = run_step(scheduler)
    assert output.scheduled[0].num_new_tokens == 16
    assert output.scheduled[0].request.num_computed_tokens == 16
    # And an embedding's blocks never become cache entries for a later request.
    scheduler.add_request(embedding("e2", 12, first=500))
    run_step(scheduler)
    later = generation("g2", 13, first=500)
    assert scheduler.kv_cache_manager.get_computed_blocks(later).num_tokens == 0
