"""Real GGUF files loaded with ``quantization="auto"`` keep their projections quantized.

SmolLM2's file stores every projection in Q4_1: each Linear of the decoder
must hold Q4_1 blocks and no float weight, and the logits must be those of
the same file dequantized (``quantization="none"``, float32). Gemma 3's
Q4_K_M file mixes types inside one fused projection (Q5_0 q/k beside a Q8_0
v in half its layers), which must become segments of a single weight.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import pytest
import torch

from kvserve import LLM
from kvserve.core.request import Request
from kvserve.core.scheduler import ScheduledRequest
from kvserve.engine import LLMEngine
from kvserve.kernels.weight_kind import WeightKind
from kvserve.layers.linear import Linear
from kvserve.layers.weight_format import QuantizedWeights
from kvserve.loader.gguf_file import open_gguf
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import prepare_inputs
from model_fixtures import gemma3_gguf_path, smollm2_gguf_path

pytestmark = pytest.mark.slow

Q = gguf.GGMLQuantizationType
PROMPT = [1, 504, 3458, 282, 4195, 314, 260, 3575, 8812, 30]


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The logits ``[len(prompt), V]`` of one prompt run as a single prefill step."""
    request = Request("p", prompt, SamplingParams())
    manager = engine.kv_cache_manager
    assert manager.allocate_slots(request, len(prompt)) is not None
    scheduled = [ScheduledRequest(request, len(prompt), manager.get_block_ids("p"), samples=False)]
    runner = engine.runner
    inputs = prepare_inputs(scheduled, runner.block_size, runner.device, runner.sliding_windows)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.forward(inputs))
    manager.free(request)
    return logits


def decoder_linears(engine: LLMEngine) -> list[tuple[str, Linear]]:
    return [
        (name, module)
        for name, module in engine.runner.model.named_modules()
        if isinstance(module, Linear) and ".layers." in name
    ]


def test_smollm2_q4_1_stays_quantized_and_computes_the_dequantized_logits() -> None:
    if smollm2_gguf_path() is None:
        pytest.skip("the SmolLM2 GGUF is not installed")
    args = dict(dtype="float32", num_blocks=16, max_model_len=128)
    quantized = LLMEngine.from_engine_args("smollm2-135m-instruct", quantization="auto", **args)
    linears = decoder_linears(quantized)
    assert len(linears) == 4 * 30
    for name, linear in linears:
        fmt = linear.format
        assert isinstance(fmt, QuantizedWeights), name
        assert {s.qtype for s in fmt.qweight.segments} == {Q.Q4_1}, name
        assert (fmt.qweight.out_features, fmt.qweight.in_features) == (
            linear.out_features,
            linear.in_features,
        )
        assert linear.weight.numel() == 0, name  # no float copy allocated
    # The blocks are Q4_1: 20 bytes per 32 weights, 0.31x of the same weights in bf16.
    quant_bytes = sum(linear.format.nbytes(linear) for _, linear in linears)
    bf16_bytes = sum(2 * linear.out_features * linear.in_features for _, linear in linears)
    assert quant_bytes < 0.45 * bf16_bytes

    dequantized = LLMEngine.from_engine_args("smollm2-135m-instruct", quantization="none", **args)
    assert not any(isinstance(m.format, QuantizedWeights) for _, m in decoder_linears(dequantized))
    ours, reference = prompt_logits(quantized, PROMPT), prompt_logits(dequantized, PROMPT)
    scale = reference.abs().max().item()
    if quantized.runner.native_decoder is not None and any(
        isinstance(linear.format, QuantizedWeights) and linear.format.decode_weight(linear)
        for _, linear in linears
    ):
        # The quantized kernels round the activations to int8 per 32 values (up to
        # 0.4% of each block's largest value); over 30 layers the logits move by a few
        # percent of their range (measured on SmolLM2: at most 5.5%, 0.9% on average,
        # a KL divergence of at most 0.026 nats per position, 9 of 10 top tokens kept).
        bound = 0.1 * scale
        log_ours, log_ref = ours.log_softmax(-1), reference.log_softmax(-1)
        kl = (log_ref.exp() * (log_ref - log_ours)).sum(-1)
        assert kl.max().item() < 0.05
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.8
    else:
        # The fallback multiplies the same dequantized weights in float32: only the
        # order of the float32 sums differs (BLAS against the C kernel).
        bound = 1e-4 * scale
    torch.testing.assert_close(ours, reference, rtol=0, atol=bound)


def test_gemma3_q4_k_m_mixed_qkv_becomes_segments_of_one_weight() -> None:
    path = gemma3_gguf_path()
    if path is None:
        pytest.skip("the Gemma 3 GGUF is not available")
    types = {t.name: t.tensor_type for t in open_gguf(Path(path)).tensors}
    assert Counter(types[f"blk.{i}.attn_v.weight"] for i in range(18))[Q.Q8_0] > 0
    engine = LLMEngine.from_engine_args(
        "gemma3-270m", quantization="auto", dtype="float32", num_blocks=16, max_model_len=128
    )
    layers = engine.runner.model.model.layers
    for i, layer in enumerate(layers):
        qkv = layer.self_attn.qkv_proj
        fmt = qkv.format
        assert isinstance(fmt, QuantizedWeights)
        q, k, v = (types[f"blk.{i}.attn_{x}.weight"] for x in "qkv")
        rows = [end - start for start, end in qkv.shard_rows.values()]
        assert q == k == Q.Q5_0
        expected = (
            [(q, rows[0] + rows[1] + rows[2])] if v == q else [(q, rows[0] + rows[1]), (v, rows[2])]
        )
        assert [(s.qtype, s.rows) for s in fmt.qweight.segments] == expected
        assert qkv.weight.numel() == 0


def test_smollm2_decode_stack_multiplies_quantized_weights_as_the_per_layer_path() -> None:
    if smollm2_gguf_path() is None:
        pytest.skip("the SmolLM2 GGUF is not installed")
    llm = LLM("smollm2-135m-instruct", dtype="float32", num_blocks=32, max_model_len=128)
    runner = llm.llm_engine.runner
    if runner.native_decoder is None:
        pytest.skip("no quantized kernels here: decode steps take the per-layer fallback")
    kinds = {kind for layer in runner.native_decoder.stack.layers for kind in layer.weight_kinds}
    assert kinds == {WeightKind.QUANT}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:4]}]
    fast = llm.generate(prompts, params, use_tqdm=False)
    runner.fast_path = None
    per_layer = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, per_layer, strict=True):
        # The same kernels on the same rows: only the order of float32 sums may differ.
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        steps = zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True)
        for step_a, step_b in steps:
            for token, logprob in step_a.items():
                assert abs(logprob.logprob - step_b[token].logprob) < 1e-3
