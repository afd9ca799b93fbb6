"""The hybrid KV cache end to end: a model with sliding-window and global layers.

The model is a tiny random Qwen2. transformers, the independent reference,
loads it with a config that gives some layers a 32-token window
(``layer_types``); kvserve loads the plain checkpoint and the test sets the
same windows on its ``Attention`` layers before the runner groups them. Windows [32, 32, None, 32, 32, None]: four sliding layers and two
global ones, so groups of two (sliding (0, 1) and (3, 4), global (2, 5)).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvserve import LLM, InvalidParameterError, SamplingParams
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.engine import llm_engine
from kvserve.kernels import native_ops
from kvserve.layers.attention import Attention
from kvserve.outputs import CompletionOutput
from kvserve.worker import model_runner
from model_fixtures import save_tiny_model, train_tiny_tokenizer

WINDOW = 32
WINDOWS = [WINDOW, WINDOW, None, WINDOW, WINDOW, None]
BLOCK_SIZE = 16
MAX_TOKENS = 100  # generation runs well past the window
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("qwen2-swa"),
        "qwen2",
        train_tiny_tokenizer(),
        num_hidden_layers=len(WINDOWS),
    )


def load_reference(model_dir: Path) -> Any:
    """The checkpoint in transformers, with the windows of ``WINDOWS``."""
    config = AutoConfig.from_pretrained(model_dir)
    config.use_sliding_window = True
    config.sliding_window = WINDOW
    config.layer_types = ["full_attention" if w is None else "sliding_attention" for w in WINDOWS]
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)


@pytest.fixture(autouse=True)
def windowed_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the model's attention layers the windows of ``WINDOWS`` as it is built."""
    build = model_runner.build_model

    def build_with_windows(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for layer, window in zip(layers, WINDOWS, strict=True):
            layer.sliding_window = window
        return model

    monkeypatch.setattr(model_runner, "build_model", build_with_windows)


@pytest.fixture
def keep_full_history(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Engines built while this is active never give sliding groups' blocks back."""
    partial = functools.partial(KVCacheManager, free_out_of_window=False)
    monkeypatch.setattr(llm_engine, "KVCacheManager", partial)
    yield
    monkeypatch.undo()


def make_llm(model_dir: Path, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(
        dtype="float32", block_size=BLOCK_SIZE, num_blocks=256, max_num_seqs=8
    )
    args.update(engine_args)
    return LLM(str(model_dir), **args)


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def completions(llm: LLM, lengths: tuple[int, ...]) -> list[CompletionOutput]:
    outputs = llm.generate(prompts(lengths), GREEDY, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def test_layers_are_grouped_over_one_shared_pool(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    runner = llm.llm_engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert [g.layer_indices for g in runner.kv_cache_groups] == [(0, 1), (3, 4), (2, 5)]
    assert [layer.kv_group for layer in layers] == [0, 0, 2, 1, 1, 2]
    assert runner.kv_cache.shape[:3] == (2, 2, 256)  # two layers deep, not six
    pool_tensors = [runner.kv_cache[0].data_ptr(), runner.kv_cache[1].data_ptr()]
    assert [layer.kv_cache.data_ptr() for layer in layers] == [
        pool_tensors[i] for i in (0, 1, 0, 0, 1, 1)
    ]
    # The one-call decode stack walks every group's tables (where the C kernels build).
    assert (runner.native_decoder is not None) == (native_ops() is not None)
    manager = llm.llm_engine.kv_cache_manager
    assert manager.sliding_windows == (WINDOW, WINDOW, None)
    assert not manager.enable_caching  # auto: off with sliding windows


def test_asking_for_prefix_caching_on_a_sliding_window_model_is_refused(model_dir: Path) -> None:
    with pytest.raises(InvalidParameterError, match="enable_prefix_caching"):
        make_llm(model_dir, enable_prefix_caching=True)
    assert not make_llm(
        model_dir, enable_prefix_caching=False
    ).llm_engine.kv_cache_manager.enable_caching


def test_greedy_tokens_and_logprobs_match_transformers(model_dir: Path) -> None:
    reference = load_reference(model_dir).eval()
    lengths = (7, 45, 90)
    for prompt, completion in zip(
        prompts(lengths), completions(make_llm(model_dir), lengths), strict=True
    ):
        tokens = prompt["prompt_token_ids"] + completion.token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([tokens[:-1]])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt["prompt_token_ids"]) - 1 :], dim=-1)
        assert completion.logprobs is not None
        for position, token in enumerate(completion.token_ids):
            row = logprobs[position]
            top2 = row.topk(2).values
            assert int(row.argmax()) == token or float(top2[0] - top2[1]) < NEAR_TIE
            assert completion.logprobs[position][token].logprob == pytest.approx(
                float(row[token]), abs=1e-4
            )


def assert_same(expected: list[CompletionOutput], actual: list[CompletionOutput]) -> None:
    for want, got in zip(expected, actual, strict=True):
        assert got.token_ids == want.token_ids


def assert_same_up_to_near_ties(
    expected: list[CompletionOutput], actual: list[CompletionOutput]
) -> None:
    """Equal tokens; a different batch may flip a genuine near-tie, and only from there on."""
    for want, got in zip(expected, actual, strict=True):
        assert want.logprobs is not None
        for position, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
            if a != b:
                gap = abs(want.logprobs[position][a].logprob - want.logprobs[position][b].logprob)
                assert gap < NEAR_TIE, f"token {position} differs, logprob gap {gap:.2e}"
                break


LENGTHS = (5, 40, 100, 130)


@pytest.mark.parametrize("backend", ["torch_paged", "auto"])
@pytest.mark.parametrize("chunk", [512, 16])
def test_giving_blocks_back_changes_no_output(
    model_dir: Path, backend: str, chunk: int, request: pytest.FixtureRequest
) -> None:
    args: dict[str, Any] = dict(attention_backend=backend, max_num_batched_tokens=chunk)
    freeing = make_llm(model_dir, **args)
    actual = completions(freeing, LENGTHS)
    engine = freeing.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_usable_blocks
    request.getfixturevalue("keep_full_history")
    keeping = make_llm(model_dir, **args)
    expected = completions(keeping, LENGTHS)
    assert_same(expected, actual)  # the same schedule: the same bits
    assert engine.peak_num_blocks_used < keeping.llm_engine.peak_num_blocks_used


def test_giving_blocks_back_changes_no_output_under_preemption(
    model_dir: Path, request: pytest.FixtureRequest
) -> None:
    # Each sequence holds at most 15 global + 2 x 4 sliding blocks; four need more than 40.
    freeing = make_llm(model_dir, num_blocks=41, max_num_batched_tokens=16)
    actual = completions(freeing, LENGTHS)
    assert freeing.llm_engine.stats.num_preemptions > 0
    request.getfixturevalue("keep_full_history")
    expected = completions(make_llm(model_dir, max_num_batched_tokens=16), LENGTHS)
    assert_same_up_to_near_ties(expected, actual)


def test_sliding_groups_hold_the_window_while_global_groups_grow(model_dir: Path) -> None:
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    engine = llm.llm_engine
    manager = engine.kv_cache_manager
    engine.add_request("long", prompts((70,))[0], SamplingParams(max_tokens=150, ignore_eos=True))
    request = engine.scheduler.requests["long"]
    max_sliding = 0
    while engine.has_unfinished_requests():
        engine.step()
        if request.is_finished:
            break
        *sliding, full = manager.num_held_blocks_per_group("long")
        assert full == -(-request.num_computed_tokens // BLOCK_SIZE)
        if request.num_computed_tokens >= request.num_prompt_tokens:  # decoding
            assert max(sliding) <= -(-WINDOW // BLOCK_SIZE) + 1
            max_sliding = max(max_sliding, *sliding)
        held = manager.num_held_blocks("long")
        assert engine.kv_bytes_held("long") == held * engine.runner.kv_bytes_per_block
    assert max_sliding == 3 and full == -(-218 // BLOCK_SIZE)  # before the last step
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert engine.kv_bytes_held("long") == 0
