"""How requests are batched, chunked or preempted never changes what they generate.

The same requests run four ways: each alone, all together, with 7-token
prefill chunks under a 32-token budget, and in a KV pool so small that
requests get preempted and recomputed. Greedy and seeded-sampling outputs
must agree in all four. Reordered floating-point sums may legitimately flip
a genuine near-tie; only then may two runs diverge, and only from that token
on (the check vLLM's ``check_logprobs_close`` makes).
"""

from __future__ import annotations

import platform
import random
from pathlib import Path
from typing import Any

import pytest

from greedy_checks import assert_same_tokens
from kvserve import LLM, SamplingParams
from kvserve.kernels import NativeOps, native_ops
from kvserve.kernels.build import load_library
from kvserve.outputs import CompletionOutput
from kvserve.worker.native_decode import NativeDecoder
from kvserve.worker.platform import cpu as cpu_platform
from model_fixtures import save_tiny_model, tiny_pool, train_tiny_tokenizer

NEAR_TIE = 1e-3  # logprob gap under which two tokens count as tied
NUM_REQUESTS = 8
MAX_TOKENS = 24


# Llama (RoPE), GPT-2 (learned positions) and the Gemmas (sliding windows, soft caps).
INVARIANCE_KINDS = ("llama", "gpt2", "gemma2", "gemma3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama, GPT-2, Gemma 2 and Gemma 3 models (the Gemmas' 16-token windows are crossed)."""
    tokenizer = train_tiny_tokenizer()
    return {
        kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, tokenizer)
        for kind in INVARIANCE_KINDS
    }


@pytest.fixture(scope="module")
def model_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


def make_requests(vocab_size: int) -> tuple[list[dict[str, list[int]]], list[SamplingParams]]:
    rng = random.Random(42)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 40))]}
        for _ in range(NUM_REQUESTS)
    ]
    params = []
    for index in range(NUM_REQUESTS):
        if index % 2 == 0:
            params.append(
                SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
            )
        else:
            params.append(
                SamplingParams(
                    temperature=0.9,
                    top_p=0.95,
                    top_k=50,
                    seed=1000 + index,
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    logprobs=2,
                )
            )
    return prompts, params


def run(
    model_dir: Path, alone: bool, dtype: str = "float32", **engine_args: Any
) -> tuple[list[CompletionOutput], int]:
    llm = LLM(str(model_dir), dtype=dtype, block_size=4, **engine_args)
    prompts, params = make_requests(llm.llm_engine.vocab_size)
    if alone:
        outputs = [
            llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params, strict=True)
        ]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outputs], llm.llm_engine.scheduler.num_preemptions_total


@pytest.mark.parametrize(
    ("kind", "dtype", "quantization"),
    [
        ("llama", "float32", "auto"),
        ("llama", "bfloat16", "auto"),
        ("gpt2", "float32", "auto"),
        ("gpt2", "bfloat16", "auto"),
        ("gemma2", "float32", "auto"),
        ("gemma3", "float32", "auto"),
        ("gemma3", "bfloat16", "auto"),
        # Quantized at load, on the int8 path at every row count (pinned below): each row's
        # activations are rounded to int8 on their own, so a row's result cannot depend on
        # the rows beside it either.
        ("llama", "float32", "q8_0"),
        # With the default many-row path a step of 12 rows or more multiplies bf16-rounded
        # activations instead: a row's logprobs then depend on how many rows its step holds
        # (by ~1e-2, as bf16 against int8 rounding), which may move a seeded sample.
        pytest.param(
            "llama",
            "float32",
            "q8_0-default-rows",
            marks=pytest.mark.xfail(
                reason="known: the quantized product takes the bf16 many-row path from 12 "
                "rows a step, which rounds differently from the int8 path of fewer rows",
                strict=False,
            ),
        ),
        pytest.param(
            "gemma3",
            "bfloat16",
            "q4_0",
            marks=pytest.mark.xfail(
                reason="known: chunked prefill's attention differs from whole prefill's in the "
                "last float bits, and rounding the activations to int8 blocks turns that into "
                "logprob differences of ~1e-2, enough to move a seeded sample here; and from "
                "12 rows a step the quantized product takes the bf16 many-row path",
                strict=False,
            ),
        ),
    ],
)
def test_outputs_do_not_depend_on_batching_chunking_or_preemption(
    model_dirs: dict[str, Path], kind: str, dtype: str, quantization: str
) -> None:
    # bfloat16: bf16 weights and a bf16 KV pool (with float32 math where the kernels run).
    model_dir = model_dirs[kind]
    ops = native_ops()
    if quantization == "q8_0" and ops is not None:
        before = ops.quant_many_rows
        ops.set_quant_many_rows(INT8_AT_EVERY_ROW_COUNT)  # the library's own threshold
        try:
            check_invariance(model_dir, kind, dtype, quantization)
        finally:
            ops.set_quant_many_rows(before)
        return
    check_invariance(model_dir, kind, dtype, quantization.removesuffix("-default-rows"))


# A row count no step reaches: linear_quant stays on its int8 path.
INT8_AT_EVERY_ROW_COUNT = 1 << 30


def check_invariance(model_dir: Path, kind: str, dtype: str, quantization: str) -> None:
    """The same tokens alone, batched, chunked and preempted."""
    engine = {"dtype": dtype, "quantization": quantization}
    alone, _ = run(model_dir, alone=True, num_blocks=tiny_pool(64, kind), **engine)
    together, _ = run(model_dir, alone=False, num_blocks=tiny_pool(256, kind), **engine)
    chunked, _ = run(
        model_dir,
        alone=False,
        **engine,
        num_blocks=tiny_pool(256, kind),
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enable_chunked_prefill=True,
    )
    # Each request needs up to 16 blocks of 4 tokens per KV cache group (a Gemma's sliding
    # layers hold their whole prompt while it is computed): 24 usable per group cannot hold
    # them all.
    preempted, num_preemptions = run(
        model_dir, alone=False, num_blocks=tiny_pool(25, kind), **engine
    )
    assert num_preemptions > 0
    for index, reference in enumerate(alone):
        assert len(reference.token_ids) == MAX_TOKENS
        for label, outputs in (
            ("together", together),
            ("chunked", chunked),
            ("preempted", preempted),
        ):
            assert_same_tokens(reference, outputs[index], f"request {index} {label}", NEAR_TIE)
            assert outputs[index].finish_reason == "length"


def count_stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time a decode step runs its layers in one C call."""
    calls: list[int] = []
    one_call_layers = NativeOps.decode_layers

    def counting(self: NativeOps, *args: Any) -> Any:
        calls.append(1)
        return one_call_layers(self, *args)

    monkeypatch.setattr(NativeOps, "decode_layers", counting)
    return calls


def kernels_built_for(target: str) -> NativeOps:
    """The kernels as built for this CPU (``native``) or for AVX2 without AVX-512."""
    if native_ops() is None:
        pytest.skip("the C kernels could not be built here")
    if target == "native":
        ops = native_ops()
    else:
        if platform.machine() != "x86_64":
            pytest.skip("the AVX2 build is for x86-64 CPUs")
        lib = load_library(target)
        ops = None if lib is None else NativeOps(lib)
    assert ops is not None
    return ops


@pytest.mark.parametrize(
    ("kind", "target"),
    [("llama", "native"), ("llama", "x86-64-v3"), ("gemma2", "native"), ("gemma3", "native")],
)
def test_native_kernels_and_pytorch_path_generate_the_same(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kind: str, target: str
) -> None:
    # x86-64-v3: the code an AVX2 CPU runs, checked on whatever CPU runs the tests.
    model_dir = model_dirs[kind]
    ops = kernels_built_for(target)
    monkeypatch.setattr(cpu_platform, "native_ops", lambda: ops)
    chunked: dict[str, Any] = dict(num_blocks=256, max_num_batched_tokens=32, max_num_seqs=8)
    fused_calls = count_stack_calls(monkeypatch)
    native, _ = run(model_dir, alone=False, **chunked)
    assert fused_calls  # decode-only steps ran every layer in one call
    # The pure PyTorch path: no kernels for the layers, the PyTorch attention backend.
    monkeypatch.setattr(cpu_platform, "native_ops", lambda: None)
    reference, _ = run(model_dir, alone=False, attention_backend="torch_paged", **chunked)
    for index, (want, got) in enumerate(zip(reference, native, strict=True)):
        assert_same_tokens(want, got, f"request {index} native", NEAR_TIE)


def test_bf16_on_the_avx2_build_generates_what_the_native_build_does(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bf16 weights widened to float32 and a bf16 pool: the same math on both builds.
    avx2 = kernels_built_for("x86-64-v3")
    portable = NativeOps(kernels_built_for("native").lib, bf16_dot=False)
    chunked: dict[str, Any] = dict(num_blocks=256, max_num_batched_tokens=32, max_num_seqs=8)
    monkeypatch.setattr(cpu_platform, "native_ops", lambda: portable)
    reference, _ = run(model_dir, alone=False, dtype="bfloat16", **chunked)
    monkeypatch.setattr(cpu_platform, "native_ops", lambda: avx2)
    outputs, _ = run(model_dir, alone=False, dtype="bfloat16", **chunked)
    for index, (want, got) in enumerate(zip(reference, outputs, strict=True)):
        assert_same_tokens(want, got, f"request {index} avx2 build", NEAR_TIE)


def pin_bf16_path(monkeypatch: pytest.MonkeyPatch, bf16_dot: bool) -> None:
    """Make new engines multiply bf16 weights on the given kernel path (skip if absent)."""
    ops = native_ops()
    if ops is None:
        pytest.skip("the C kernels could not be built here")
    if bf16_dot and not ops.bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16: only the portable path runs here")
    lib = load_library()
    assert lib is not None
    pinned = NativeOps(lib, bf16_dot=bf16_dot)
    monkeypatch.setattr(cpu_platform, "native_ops", lambda: pinned)


@pytest.mark.parametrize(
    ("kind", "dtype", "bf16_dot"),
    [
        ("llama", "float32", False),
        ("qwen2", "bfloat16", False),
        ("qwen2", "bfloat16", True),
        ("llama", "bfloat16", True),
        ("qwen3", "float32", False),
        ("qwen3", "bfloat16", True),
        ("gpt2", "float32", False),
        ("gpt2", "bfloat16", True),
        ("gemma2", "float32", False),
        ("gemma3", "float32", False),
        ("gemma2", "bfloat16", True),
        ("gemma3", "bfloat16", True),
    ],
)
def test_one_call_decode_stack_equals_the_per_layer_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, dtype: str, bf16_dot: bool
) -> None:
    # The stack chains the very kernels the per-layer path calls, so the logprobs must
    # be bit-identical: q/k/v bias (qwen2), bf16 weights on either kernel path and the
    # bf16 KV pool included. With q/k norms (qwen3, gemma3) the per-layer path normalises
    # and rotates q and k in PyTorch, which rounds differently: equal to float32 rounding.
    # Under bf16 dot products (the linear layers' activations, and the attention's query
    # and softmax weights, are rounded to bf16) such a last-bit difference is mostly
    # absorbed, but now and then flips one rounding (a 2^-8 relative step): the tiny
    # models' sampled runs then move a logprob by up to ~1e-2.
    # GPT-2's LayerNorms and GELU take the same kernels on both paths: bit-identical too.
    pin_bf16_path(monkeypatch, bf16_dot)
    folder = save_tiny_model(tmp_path, kind, train_tiny_tokenizer())

    def generate() -> list[CompletionOutput]:
        llm = LLM(str(folder), dtype=dtype, block_size=4, num_blocks=256)
        prompts, params = make_requests(llm.llm_engine.vocab_size)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    stack_calls = count_stack_calls(monkeypatch)
    stacked = generate()
    assert stack_calls
    monkeypatch.setattr(NativeDecoder, "for_model", classmethod(lambda cls, model, ops=None: None))
    per_layer = generate()
    for want, got in zip(per_layer, stacked, strict=True):
        assert got.token_ids == want.token_ids
        if kind not in ("qwen3", "gemma3"):
            assert got.logprobs == want.logprobs
            continue
        assert want.logprobs is not None and got.logprobs is not None
        tolerance = 2e-2 if bf16_dot else 1e-5
        for want_top, got_top in zip(want.logprobs, got.logprobs, strict=True):
            assert want_top.keys() == got_top.keys()
            for token, logprob in want_top.items():
                assert got_top[token].logprob == pytest.approx(logprob.logprob, abs=tolerance)


def test_seeded_sampling_differs_across_seeds_and_from_greedy(model_dir: Path) -> None:
    # Guards the test above against passing vacuously (e.g. sampling ignoring the seed).
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_blocks=128)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    results = [
        llm.generate(
            prompt,
            SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        for seed in (1, 2, 1)
    ]
    assert results[0] == results[2]
    assert results[0] != results[1]
