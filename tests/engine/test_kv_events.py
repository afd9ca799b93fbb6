"""KV cache events tell the truth about the prefix cache, in process and over ZMQ.

A subscriber that applies the events in order must end up with exactly the
hashes the block pool holds, after every step; every stored block's hash must
be the chained hash of its tokens. test_kv_event_publisher.py checks the
same batches on the wire.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kv_events_fixtures import BLOCK_SIZE, PARAMS, make_engine, workload
from kvserve.core import kv_events
from kvserve.core.block_hash import BlockHash, extend_block_hashes, hash_block_tokens
from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvserve.engine.kv_event_publisher import ZmqKVEventPublisher
from kvserve.errors import InvalidParameterError
from model_fixtures import save_tiny_model, train_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


def apply(batch: KVEventBatch, cached: set[BlockHash], stored: list[BlockStored]) -> None:
    """What a router does with a batch: mirror the replica's cache."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert not cached & set(event.block_hashes), "a hash was stored twice"
            cached.update(event.block_hashes)
            stored.append(event)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= cached, "removed a hash never stored"
            cached.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            cached.clear()


def check_chain(event: BlockStored) -> None:
    """Each stored hash is the chained hash of its tokens, from the stated parent."""
    parent = event.parent_block_hash
    assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
    for index, block_hash in enumerate(event.block_hashes):
        tokens = event.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        assert hash_block_tokens(parent, tokens, None) == block_hash
        parent = block_hash


def test_events_mirror_the_block_pool_step_by_step(model_dir: Path) -> None:
    engine = make_engine(model_dir, enable_kv_cache_events=True)
    pool = engine.kv_cache_manager.block_pool
    prompts = workload()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, PARAMS)
    cached: set[BlockHash] = set()
    stored: list[BlockStored] = []
    num_removed = 0
    while engine.has_unfinished_requests():
        engine.step()
        for batch in engine.take_kv_events():
            num_removed += sum(isinstance(e, BlockRemoved) for e in batch.events)
            apply(batch, cached, stored)
        assert cached == pool.cached_block_hashes()
    assert num_removed > 0, "the workload was meant to evict"
    for event in stored:
        check_chain(event)
        assert event.medium == "CPU" and event.lora_id is None
    # Every full prompt block was announced, with the prompt's own tokens.
    announced = {
        block_hash: event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        for event in stored
        for i, block_hash in enumerate(event.block_hashes)
    }
    for prompt in prompts:
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, prompt, BLOCK_SIZE, None)
        for block, block_hash in enumerate(hashes):
            assert announced[block_hash] == tuple(
                prompt[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]
            )
    assert engine.reset_prefix_cache()
    (batch,) = engine.take_kv_events()
    assert batch.events == (AllBlocksCleared(),)
    assert pool.cached_block_hashes() == set()


def test_events_are_off_by_default_and_build_nothing(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an event collector was built with events off")

    monkeypatch.setattr(kv_events.KVEventCollector, "__init__", refuse)
    engine = make_engine(model_dir)
    assert engine.kv_cache_manager.block_pool.events is None
    for index, prompt in enumerate(workload(1)):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, PARAMS)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.take_kv_events() == []


def test_bad_kv_events_settings_are_refused(model_dir: Path) -> None:
    with pytest.raises(InvalidParameterError, match="kv_events_replay_endpoint"):
        make_engine(model_dir, kv_events_replay_endpoint="tcp://127.0.0.1:*")
    with pytest.raises(InvalidParameterError, match="kv_events_endpoint"):
        make_engine(model_dir, kv_events_endpoint="localhost")
    with pytest.raises(InvalidParameterError, match="kv_events_buffer_steps"):
        make_engine(model_dir, enable_kv_cache_events=True, kv_events_buffer_steps=0)


def test_publishing_without_the_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq now raises ImportError
    with pytest.raises(ImportError, match=r"kvserve\[kv-events\]"):
        ZmqKVEventPublisher("tcp://127.0.0.1:*")
