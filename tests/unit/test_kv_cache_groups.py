"""KV cache groups: how layers are grouped, and the per-group tables of the manager."""

from __future__ import annotations

import pytest

from kvserve.config import CacheConfig
from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.kv_cache_groups import (
    KVCacheGroupSpec,
    blocks_for_sequence,
    group_blocks_for_sequence,
    make_kv_cache_groups,
    num_pool_layers,
)
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

# Gemma 3 270M: 18 layers, every sixth global, the rest with a 512-token window.
GEMMA3_270M_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


def test_gemma3_layers_form_five_sliding_groups_and_one_global_group_of_three() -> None:
    groups = make_kv_cache_groups(GEMMA3_270M_WINDOWS)
    assert num_pool_layers(groups) == 3
    assert [g.sliding_window for g in groups] == [512] * 5 + [None]
    assert [g.layer_indices for g in groups] == [
        (0, 1, 2),
        (3, 4, 6),
        (7, 8, 9),
        (10, 12, 13),
        (14, 15, 16),
        (5, 11, 17),
    ]


def test_alternating_layers_form_two_groups_of_half_the_layers() -> None:
    groups = make_kv_cache_groups([4096, None] * 13)  # Gemma 2 2B: 26 layers
    assert [(g.sliding_window, g.layer_indices) for g in groups] == [
        (4096, tuple(range(0, 26, 2))),
        (None, tuple(range(1, 26, 2))),
    ]


def test_one_attention_type_is_one_group_of_every_layer() -> None:
    assert make_kv_cache_groups([None] * 30) == (KVCacheGroupSpec(tuple(range(30)), None),)
    assert make_kv_cache_groups([64] * 4) == (KVCacheGroupSpec((0, 1, 2, 3), 64),)


def test_a_count_that_is_not_a_multiple_of_the_group_size_ends_with_a_smaller_group() -> None:
    windows = [8] * 7 + [None] * 3
    groups = make_kv_cache_groups(windows)
    assert [len(g.layer_indices) for g in groups] == [3, 3, 1, 3]
    assert sorted(i for g in groups for i in g.layer_indices) == list(range(10))


@pytest.mark.parametrize("windows", [[], [0, None], [-4], [True, None]])
def test_bad_windows_are_refused(windows: list) -> None:
    with pytest.raises(ValueError):
        make_kv_cache_groups(windows)


@pytest.mark.parametrize(
    ("window", "num_tokens", "chunk", "expected"),
    [
        (None, 2048, 1, 128),
        (32, 2048, 1, 3),  # decode: the window's 2 blocks, plus one it straddles
        (32, 20, 1, 2),  # shorter than the window: the whole sequence
        (32, 2048, 64, 7),  # 31 earlier keys + a 64-token chunk span 95 positions
        (32, 2048, 2048, 128),  # one chunk of everything
    ],
)
def test_blocks_one_group_holds_at_most(
    window: int | None, num_tokens: int, chunk: int, expected: int
) -> None:
    assert group_blocks_for_sequence(window, num_tokens, 16, chunk) == expected


def make_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, [1] * num_tokens, SamplingParams())


def decode_to(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Compute ``request`` one token at a time until it has ``num_tokens`` tokens."""
    while request.num_computed_tokens < num_tokens:
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.release_unreachable_blocks(request)


def test_sliding_tables_keep_positions_and_null_the_blocks_left_behind() -> None:
    manager = KVCacheManager(64, 4, sliding_windows=(8, None))
    request = make_request("r", 30)
    decode_to(manager, request, 30)
    sliding, full = manager.get_block_ids("r")
    # Position 30 (next) sees keys 23..30: blocks 5 (20..23) onwards are kept.
    assert sliding[:5] == [NULL_BLOCK_ID] * 5
    assert NULL_BLOCK_ID not in sliding[5:] and len(sliding) == 8
    assert len(full) == 8 and NULL_BLOCK_ID not in full
    assert manager.num_held_blocks_per_group("r") == (3, 8)
    assert manager.num_held_blocks("r") == 11
    assert manager.num_free_blocks == 63 - 11
    manager.free(request)
    assert manager.num_free_blocks == 63
    assert manager.get_block_ids("r") == ([], [])


def test_without_freeing_every_group_keeps_its_whole_history() -> None:
    manager = KVCacheManager(64, 4, sliding_windows=(8, None), free_out_of_window=False)
    request = make_request("r", 30)
    decode_to(manager, request, 30)
    assert manager.num_held_blocks_per_group("r") == (8, 8)


def test_an_allocation_that_fits_only_some_groups_changes_nothing() -> None:
    manager = KVCacheManager(8, 4, sliding_windows=(None, None, None))  # 7 usable blocks
    request = make_request("r", 12)
    assert manager.allocate_slots(request, 8) is not None  # 2 blocks in each group
    request.num_computed_tokens = 8
    tables = manager.get_block_ids("r")
    assert manager.allocate_slots(request, 1) is None  # needs 3, one is free
    assert manager.get_block_ids("r") == tables
    assert manager.num_free_blocks == 1


def test_a_step_inside_the_held_blocks_takes_nothing_and_one_past_them_takes_a_block() -> None:
    manager = KVCacheManager(8, 4, sliding_windows=(None, None))  # 7 usable blocks
    request = make_request("r", 12)
    assert manager.allocate_slots(request, 6) is not None
    tables = manager.get_block_ids("r")
    assert [len(t) for t in tables] == [2, 2]
    request.num_computed_tokens = 6
    for computed in (6, 7):  # positions 6 and 7 lie in each table's second block
        request.num_computed_tokens = computed
        assert manager.allocate_slots(request, 1) == ([], [])
        assert manager.get_block_ids("r") == tables and manager.num_free_blocks == 3
    request.num_computed_tokens = 8  # position 8 starts a third block in both groups
    added = manager.allocate_slots(request, 1)
    assert added is not None and [len(ids) for ids in added] == [1, 1]
    assert manager.num_free_blocks == 1
    assert [t[:2] for t in manager.get_block_ids("r")] == list(tables)


def test_blocks_leaving_the_window_count_as_free_for_the_same_allocation() -> None:
    manager = KVCacheManager(6, 4, sliding_windows=(4,))  # 5 usable blocks
    request = make_request("r", 40)
    assert manager.allocate_slots(request, 20) is not None  # 5 blocks, pool full
    request.num_computed_tokens = 20
    assert manager.num_free_blocks == 0
    # Position 20 sees 17..20: blocks 0..3 go back, and one of them takes positions 20..23.
    new_blocks = manager.allocate_slots(request, 4)
    assert new_blocks is not None and len(new_blocks[0]) == 1
    assert manager.num_held_blocks("r") == 2
    assert manager.num_free_blocks == 3


def test_a_failed_allocation_keeps_the_blocks_it_would_have_given_back() -> None:
    manager = KVCacheManager(6, 4, sliding_windows=(4, None))  # 5 usable blocks
    request = make_request("r", 40)
    assert manager.allocate_slots(request, 8) is not None  # 2 blocks per group
    request.num_computed_tokens = 8
    # Sliding: block 0 could go back; both groups need blocks for 8..23: 4 + 4 > 1 + 1.
    assert manager.allocate_slots(request, 16) is None
    assert manager.num_held_blocks_per_group("r") == (2, 2)
    assert manager.num_free_blocks == 1


def test_can_ever_fit_counts_every_group_and_the_chunk() -> None:
    manager = KVCacheManager(40, 16, sliding_windows=(32, None))  # 39 usable blocks
    # 512 tokens: 32 global blocks + a sliding group holding 3 while decoding.
    assert manager.num_blocks_for(512, max_chunk_tokens=1) == 35
    assert manager.can_ever_fit(512, max_chunk_tokens=64)  # 32 + 7
    assert not manager.can_ever_fit(512, max_chunk_tokens=128)  # 32 + 11
    assert not manager.can_ever_fit(512)  # one chunk of 512: 32 + 32
    assert blocks_for_sequence((32, None), 512, 16, 1) == 35


def test_prefix_caching_needs_a_single_global_group() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(16, 4, enable_caching=True, sliding_windows=(8, None))
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(16, 4, enable_caching=True, sliding_windows=(8,))
    assert KVCacheManager(16, 4, enable_caching=True).enable_caching


@pytest.mark.parametrize(
    ("setting", "has_sliding_window", "expected"),
    [(None, False, True), (True, False, True), (False, False, False), (None, True, False)],
)
def test_prefix_caching_is_on_by_default_unless_the_model_has_windows(
    setting: bool | None, has_sliding_window: bool, expected: bool
) -> None:
    config = CacheConfig(enable_prefix_caching=setting)
    assert config.prefix_caching_for(has_sliding_window) is expected


def test_asking_for_prefix_caching_with_windows_names_the_parameter() -> None:
    with pytest.raises(InvalidParameterError, match=r"enable_prefix_caching.*sliding-window"):
        CacheConfig(enable_prefix_caching=True).prefix_caching_for(has_sliding_window=True)
    with pytest.raises(InvalidParameterError, match="enable_prefix_caching"):
        CacheConfig(enable_prefix_caching="yes")  # type: ignore[arg-type]
