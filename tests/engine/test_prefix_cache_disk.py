"""The prefix cache's disk tier never changes what a request generates.

On a tiny random Llama in float32, with blocks of 4 tokens so that every
prompt spans several: blocks read back from disk (after the pool evicted
them, or by a new engine on the same folder) give the same tokens as
computing everything, and bit for bit the same logprobs as taking the same
blocks from the pool. (Against no cache at all the logprobs may differ in the last bits:
the rest of the prompt is computed in a chunk of another shape.) Files that
must not be used (damaged, truncated, writable by others, another model's or
model setting's, another tenant's) are not, and a disk that fails only turns
the tier off. Only blocks of prompts are written: an answer reaches the disk
when a later prompt sends it back. Nothing here depends on the model: the
tier stores the pool's bytes, whatever weights and format produced them.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config.cache import CacheConfig
from kvserve.core.block_hash import hash_block_tokens
from kvserve.core.disk_store import DiskTierCounters
from kvserve.errors import InvalidParameterError
from kvserve.outputs import CompletionOutput
from model_fixtures import save_tiny_model, train_tiny_tokenizer

BLOCK_SIZE = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def make_llm(model: Path, folder: Path | None, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(dtype="float32", block_size=BLOCK_SIZE, num_blocks=20)
    if folder is None:
        args["enable_prefix_caching"] = False
    else:
        args["prefix_cache_dir"] = str(folder)
    args.update(engine_args)
    return LLM(str(model), **args)


def prompt_tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(count)]  # the tiny vocabulary, no specials


# 8 full blocks and 2 tokens. The random model's distributions are flat enough for
# near-ties; at each of this prompt's greedy steps the top two are 0.2 apart or more
# (float32 and bfloat16), so a token that changes is the cache's doing, not rounding.
PROMPT = prompt_tokens(6, 34)
OTHER = prompt_tokens(2, 62)  # fills the small pool: evicts PROMPT's blocks


def generate(llm: LLM, tokens: list[int], salt: str | None = None) -> CompletionOutput:
    output = llm.generate({"prompt_token_ids": tokens}, PARAMS, use_tqdm=False, cache_salt=salt)
    tier = llm.llm_engine.disk_tier
    if tier is not None:
        tier.flush()  # the blocks of this request are on disk before the next one
    return output[0].outputs[0]


def counters(llm: LLM) -> DiskTierCounters:
    """The store's counters now (the step report's copy is taken at the end of each
    step, before the writer thread has written that step's blocks)."""
    store = llm.llm_engine.kv_cache_manager.disk_store
    assert store is not None
    return store.snapshot().counters


def assert_same_tokens(expected: CompletionOutput, actual: CompletionOutput) -> None:
    """Equal tokens, and logprobs equal up to float32 rounding of another chunk shape."""
    assert actual.token_ids == expected.token_ids
    assert expected.logprobs is not None and actual.logprobs is not None
    for want, got in zip(expected.logprobs, actual.logprobs, strict=True):
        assert want.keys() == got.keys()
        for token_id, logprob in want.items():
            assert got[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)


def assert_no_block_held(llm: LLM) -> None:
    stats = llm.llm_engine.stats
    assert stats.num_blocks_free == stats.num_blocks_total
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shape with other weights: the same block hashes, other K/V bytes."""
    folder = tmp_path_factory.mktemp("other")
    return save_tiny_model(folder, "llama", train_tiny_tokenizer(), seed=1)


@pytest.fixture(scope="module")
def expected(model: Path) -> CompletionOutput:
    return generate(make_llm(model, None), PROMPT)


def test_disk_hits_after_eviction_and_after_a_restart_match_computing_everything(
    model: Path, tmp_path: Path, expected: CompletionOutput
) -> None:
    llm = make_llm(model, tmp_path)
    assert_same_tokens(expected, generate(llm, PROMPT))
    assert counters(llm).writes == 34 // BLOCK_SIZE  # the prompt's full blocks

    hits_before = llm.llm_engine.stats.prefix_cache_hits
    from_pool = generate(llm, PROMPT)
    assert llm.llm_engine.stats.prefix_cache_hits - hits_before == 32
    assert counters(llm).loads == 0
    assert_same_tokens(expected, from_pool)

    generate(llm, OTHER)  # 17 blocks of 19: PROMPT's free blocks are reused
    hits_before = llm.llm_engine.stats.prefix_cache_hits
    from_disk = generate(llm, PROMPT)
    loads = counters(llm).loads
    assert loads > 0 and counters(llm).hits == loads
    assert llm.llm_engine.stats.prefix_cache_hits - hits_before == 32
    assert_same_tokens(expected, from_disk)
    assert from_disk.logprobs == from_pool.logprobs  # the same K/V bytes, bit for bit
    assert_no_block_held(llm)
    llm.llm_engine.shutdown()

    restarted = make_llm(model, tmp_path)
    after_restart = generate(restarted, PROMPT)
    assert counters(restarted).loads == 8
    assert restarted.llm_engine.stats.prefix_cache_hits == 32
    assert_same_tokens(expected, after_restart)
    assert after_restart.logprobs == from_pool.logprobs
    assert_no_block_held(restarted)


LONG = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def file_names(llm: LLM) -> set[str]:
    store = llm.llm_engine.kv_cache_manager.disk_store
    assert store is not None
    return {path.name for path in store.folder.iterdir()}


def generate_long(llm: LLM, tokens: list[int]) -> list[int]:
    output = llm.generate({"prompt_token_ids": tokens}, LONG, use_tqdm=False)
    tier = llm.llm_engine.disk_tier
    assert tier is not None
    tier.flush()
    return list(output[0].outputs[0].token_ids)


def test_a_long_answer_writes_only_its_prompts_full_blocks(model: Path, tmp_path: Path) -> None:
    llm = make_llm(model, tmp_path, num_blocks=40)
    answer = generate_long(llm, PROMPT)
    # 34 + 29 computed tokens fill 15 blocks, all in the pool's prefix cache; the 8
    # of the prompt alone are written, the 7 that hold generated tokens are not.
    cached = llm.llm_engine.kv_cache_manager.block_pool.cached_block_hashes()
    assert set(_chain(PROMPT + answer, None)[:15]) <= cached
    assert counters(llm).writes == 8
    assert file_names(llm) == {h.hex() for h in _chain(PROMPT, None)}


def test_writing_all_blocks_also_writes_the_answers_and_a_restart_reads_them(
    model: Path, tmp_path: Path
) -> None:
    llm = make_llm(model, tmp_path, num_blocks=40, prefix_cache_disk_write="all")
    answer = generate_long(llm, PROMPT)
    # All 15 full blocks of prompt and answer are written, the 7 of generated tokens too.
    assert counters(llm).writes == 15
    assert file_names(llm) == {h.hex() for h in _chain(PROMPT + answer, None)[:15]}
    second_turn = PROMPT + answer
    restarted = make_llm(model, tmp_path, num_blocks=40, prefix_cache_disk_write="all")
    generate(restarted, second_turn)
    # The answer's blocks come from disk too (with prompts only written, 8 would).
    assert counters(restarted).loads == 15


def test_prefix_cache_disk_write_is_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="prefix_cache_disk_write"):
        CacheConfig(prefix_cache_dir=str(tmp_path), prefix_cache_disk_write="answers")  # type: ignore[arg-type]


def test_a_second_turn_writes_the_first_answer_from_the_pool_and_a_restart_reads_it(
    model: Path, tmp_path: Path
) -> None:
    llm = make_llm(model, tmp_path, num_blocks=40)
    answer = generate_long(llm, PROMPT)
    assert counters(llm).writes == 8
    turn = PROMPT + answer + prompt_tokens(7, 6)  # 70 tokens: 17 full blocks
    hits_before = llm.llm_engine.stats.prefix_cache_hits
    generate(llm, turn)
    # The first turn's 15 cached blocks were hits, 7 of them not on disk: written now,
    # with the 2 blocks the second turn computed.
    assert llm.llm_engine.stats.prefix_cache_hits - hits_before == 60
    assert counters(llm).writes == 17
    assert file_names(llm) == {h.hex() for h in _chain(turn, None)}
    from_pool = generate(llm, turn)  # every block on disk already: none written again
    assert counters(llm).writes == 17
    llm.llm_engine.shutdown()

    restarted = make_llm(model, tmp_path, num_blocks=40)
    from_disk = generate(restarted, turn)
    assert counters(restarted).loads == 17 and counters(restarted).writes == 0
    assert restarted.llm_engine.stats.prefix_cache_hits == 68
    assert from_disk.token_ids == from_pool.token_ids
    assert from_disk.logprobs == from_pool.logprobs  # the same K/V bytes, bit for bit


@pytest.mark.parametrize(
    "changed",
    [{"kv_cache_dtype": "bfloat16"}, {"block_size": 8}, {"model": "other"}],
    ids=["kv dtype", "block size", "model"],
)
def test_another_kv_setting_reads_none_of_the_blocks(
    model: Path, tmp_path: Path, changed: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    generate(make_llm(model, tmp_path), PROMPT)
    engine_args = dict(changed)
    if engine_args.pop("model", None):
        model = request.getfixturevalue("other_model")
    other = make_llm(model, tmp_path, **engine_args)
    generate(other, PROMPT)
    assert counters(other).hits == counters(other).loads == 0
    assert other.llm_engine.stats.prefix_cache_hits == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # one folder per identity


def test_a_short_run_below_the_threshold_is_recomputed(model: Path, tmp_path: Path) -> None:
    generate(make_llm(model, tmp_path), PROMPT)
    picky = make_llm(model, tmp_path, prefix_cache_disk_min_blocks=9)  # PROMPT has 8 to read
    generate(picky, PROMPT)
    assert counters(picky).loads == 0 and picky.llm_engine.stats.prefix_cache_hits == 0
    assert counters(picky).hits == 8  # found, but not worth reading
    # A reset that includes the disk tier leaves nothing to find.
    assert picky.llm_engine.reset_prefix_cache(disk=True)
    generate(picky, PROMPT)
    assert counters(picky).hits == 8


def test_bad_files_are_refused_and_the_request_still_succeeds(
    model: Path, tmp_path: Path, expected: CompletionOutput
) -> None:
    llm = make_llm(model, tmp_path)
    generate(llm, PROMPT)
    folder = llm.llm_engine.kv_cache_manager.disk_store.folder
    hashes = llm.llm_engine.scheduler.kv_cache_manager.block_pool.cached_block_hashes()
    files = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert {bytes.fromhex(p.name) for p in files} <= hashes
    # Block 5 truncated, block 3 with a flipped byte, block 6 writable by others.
    chain = _chain(PROMPT, None)
    truncated, flipped, shared = (folder / chain[i].hex() for i in (5, 3, 6))
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0x40
    flipped.write_bytes(bytes(data))
    os.chmod(shared, 0o666)

    restarted = make_llm(model, tmp_path)
    output = generate(restarted, PROMPT)
    assert_same_tokens(expected, output)
    # The truncated file goes at start; the flipped one stops the run at block 3.
    assert counters(restarted).loads == 3
    assert counters(restarted).refused == 2
    assert_no_block_held(restarted)
    # The recomputed blocks were written again, whole; the file others can write was
    # left as it is (its hash was on disk), and is refused when read.
    full_size = (folder / chain[0].hex()).stat().st_size
    assert truncated.stat().st_size == flipped.stat().st_size == full_size
    assert counters(restarted).writes == 2
    again = make_llm(model, tmp_path)
    assert_same_tokens(expected, generate(again, PROMPT))
    assert counters(again).refused == 1 and counters(again).loads == 6
    assert (folder / chain[6].hex()).stat().st_mode & 0o777 == 0o600  # written anew


def _chain(tokens: list[int], salt: str | None) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[start : start + BLOCK_SIZE], salt))
    return hashes


def test_salted_blocks_are_named_by_the_salted_hash_and_never_cross_tenants(
    model: Path, tmp_path: Path
) -> None:
    llm = make_llm(model, tmp_path)
    generate(llm, PROMPT, salt="tenant-a")
    folder = llm.llm_engine.kv_cache_manager.disk_store.folder
    names = {p.name for p in folder.iterdir()}
    assert {h.hex() for h in _chain(PROMPT, "tenant-a")[:8]} <= names
    assert not names & {h.hex() for h in _chain(PROMPT, None)}
    restarted = make_llm(model, tmp_path)
    for salt in ("tenant-b", None):
        generate(restarted, PROMPT, salt=salt)
    assert counters(restarted).loads == 0 and restarted.llm_engine.stats.prefix_cache_hits == 0
    fresh = make_llm(model, tmp_path)
    generate(fresh, PROMPT, salt="tenant-a")
    assert counters(fresh).loads == 8


def test_a_failing_disk_logs_one_warning_and_requests_succeed(
    model: Path,
    tmp_path: Path,
    expected: CompletionOutput,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    llm = make_llm(model, tmp_path)

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvserve.core.disk_store.os.replace", disk_full)
    with caplog.at_level(logging.WARNING):
        assert_same_tokens(expected, generate(llm, PROMPT))
        generate(llm, OTHER)
        assert_same_tokens(expected, generate(llm, PROMPT))
    warnings = [r for r in caplog.records if "disk tier is off" in r.getMessage()]
    assert len(warnings) == 1
    snapshot = llm.llm_engine.stats.disk_tier
    assert snapshot is not None and not snapshot.enabled and snapshot.counters.writes == 0
    assert_no_block_held(llm)


def test_bfloat16_blocks_from_disk_equal_those_from_the_pool(model: Path, tmp_path: Path) -> None:
    """In bfloat16 a disk hit is the pool hit bit for bit; against no cache, the
    tokens agree up to a near-tie, the tolerance of the pool's prefix cache."""
    bf16: dict[str, Any] = dict(dtype="bfloat16")
    reference = generate(make_llm(model, None, **bf16), PROMPT)
    llm = make_llm(model, tmp_path, **bf16)
    generate(llm, PROMPT)
    from_pool = generate(llm, PROMPT)
    llm.llm_engine.shutdown()
    restarted = make_llm(model, tmp_path, **bf16)
    from_disk = generate(restarted, PROMPT)
    assert counters(restarted).loads == 8
    assert from_disk.token_ids == from_pool.token_ids
    assert from_disk.logprobs == from_pool.logprobs
    assert reference.logprobs is not None
    for position, (want, got) in enumerate(
        zip(reference.token_ids, from_disk.token_ids, strict=True)
    ):
        if want != got:
            near = reference.logprobs[position]
            assert got in near, f"token {position} differs, and not at a near-tie"
            gap = abs(near[want].logprob - near[got].logprob)
            assert gap < 1e-2, f"token {position} differs, logprob gap {gap:.2e}"
            break
