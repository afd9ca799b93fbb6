"""The scheduler with the suffix method: same tokens, and the proposer hears of every finish.

Uses the position-driven fake model of test_spec_scheduler.py, so any
correct scheduler produces the same tokens with and without proposals.
"""

from __future__ import annotations

# Same directory: pytest puts it on the path (no package __init__ in tests/unit).
from test_spec_scheduler import BLOCK_SIZE, make_request, make_scheduler, run_all, run_step

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.core.suffix_proposer import SuffixProposer


def make_suffix_scheduler(max_cached_requests: int = 4) -> Scheduler:
    spec = SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=4,
        suffix_decoding_max_cached_requests=max_cached_requests,
    )
    kv = KVCacheManager(200, BLOCK_SIZE, enable_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    return Scheduler(config, kv, max_model_len=4096, speculative_config=spec)


def test_outputs_match_and_proposals_are_accepted() -> None:
    plain = [make_request(f"r{i}", 5 + 7 * i, 30) for i in range(3)]
    run_all(make_scheduler(False), plain)
    scheduler = make_suffix_scheduler()
    assert isinstance(scheduler.proposer, SuffixProposer)
    suffix = [make_request(f"r{i}", 5 + 7 * i, 30) for i in range(3)]
    run_all(scheduler, suffix)
    for want, got in zip(plain, suffix, strict=True):
        assert got.output_token_ids == want.output_token_ids
    assert scheduler.num_spec_accepted_total > 0
    proposer = scheduler.proposer
    assert proposer.request_counts == {}  # each request's own counts went with it
    assert {key: list(value) for key, value in proposer.cached_outputs.items()} == {
        r.request_id: r.output_token_ids for r in suffix
    }


def test_aborted_requests_leave_nothing_behind() -> None:
    scheduler = make_suffix_scheduler()
    running, waiting = make_request("run", 20, 50), make_request("wait", 9, 50)
    scheduler.add_request(running)
    for _ in range(4):
        run_step(scheduler)
    scheduler.add_request(waiting)
    proposer = scheduler.proposer
    assert isinstance(proposer, SuffixProposer) and "run" in proposer.request_counts
    scheduler.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert proposer.request_counts == {}
    # The aborted request's partial output is still text the model wrote.
    assert list(proposer.cached_outputs) == ["run"]
    assert proposer.cached_outputs["run"] == running.output_token_ids


def test_an_errored_request_is_not_kept() -> None:
    scheduler = make_suffix_scheduler()
    request: Request = make_request("bad", 20, 50)
    scheduler.add_request(request)
    for _ in range(4):
        run_step(scheduler)
    scheduler.finish_requests(["bad"], RequestStatus.FINISHED_ERROR)
    proposer = scheduler.proposer
    assert isinstance(proposer, SuffixProposer)
    assert proposer.request_counts == {} and not proposer.cached_outputs
