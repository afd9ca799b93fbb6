"""A tiny Gemma 3 over 2,048 tokens: its sliding layers hold the window, its global layer all.

The model's own config decides which layers slide (Gemma 3's layer pattern,
window 32); the KV cache's per-group block counts are read after every step.
"""

from __future__ import annotations

from pathlib import Path

from kvserve import LLM, SamplingParams
from model_fixtures import save_tiny_model, train_tiny_tokenizer

WINDOW = 32
BLOCK_SIZE = 16


def test_tiny_gemma3_over_2048_tokens_keeps_its_sliding_layers_to_the_window(
    tmp_path: Path,
) -> None:
    # The model's own config decides the windows: Gemma 3's layer pattern, window 32.
    folder = save_tiny_model(
        tmp_path,
        "gemma3",
        train_tiny_tokenizer(),
        sliding_window=WINDOW,
        max_position_embeddings=4096,
    )
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=1024,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    engine = llm.llm_engine
    manager = engine.kv_cache_manager
    windows = engine.runner.sliding_windows
    assert sorted(windows, key=str) == [32, 32, 32, None]  # three sliding layers, one global
    engine.add_request(
        "long",
        {"prompt_token_ids": [5 + i % 90 for i in range(2000)]},
        SamplingParams(max_tokens=48, ignore_eos=True),
    )
    request = engine.scheduler.requests["long"]
    window_blocks = -(-WINDOW // BLOCK_SIZE) + 1  # the window, plus the block it starts in
    chunk_blocks = -(-64 // BLOCK_SIZE)  # while a 64-token prompt chunk is computed
    decode_steps = 0
    while not request.is_finished:
        engine.step()
        if request.is_finished:
            break
        held = manager.num_held_blocks_per_group("long")
        sliding = [n for n, w in zip(held, windows, strict=True) if w is not None]
        (full,) = [n for n, w in zip(held, windows, strict=True) if w is None]
        assert full == -(-request.num_computed_tokens // BLOCK_SIZE)  # the global layer keeps all
        if request.num_computed_tokens > request.num_prompt_tokens:
            decode_steps += 1
            assert max(sliding) <= window_blocks
        else:
            assert max(sliding) <= window_blocks + chunk_blocks
    assert decode_steps >= 40 and full >= 2040 // BLOCK_SIZE  # the last step reached 2,047 tokens
    assert manager.num_free_blocks == manager.num_usable_blocks
