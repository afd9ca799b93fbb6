"""What this machine can do at best, measured on the spot, and what a token costs.

Decode is a set of matrix products with as many rows as there are sequences
in the batch; its ceiling is the matmul throughput at those shapes (or,
for small batches, the memory bandwidth needed to stream the weights). The
benchmark measures both so kvserve's figures can be read as a fraction of
what the hardware allows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.config.dtype import cpu_has_native_bf16
from kvserve.kernels import native_ops
from kvserve.models.arch_config import ArchConfig

if TYPE_CHECKING:
    from kvserve.benchmarks.timings import DecodeStep
    from kvserve.engine import LLMEngine

CPU = torch.device("cpu")


def _time_op(
    fn: object, min_time_s: float = 0.3, sync: Callable[[], object] = lambda: None
) -> float:
    """Seconds per call of ``fn``: the best of several timed batches after a warm-up.

    sync: waits for the device to finish queued work (a GPU runs ``fn`` asynchronously).
    """
    assert callable(fn)
    fn()
    sync()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s / 5:
            break
        calls *= 2
    best = elapsed / calls
    deadline = time.perf_counter() + min_time_s
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _synchronizer(device: torch.device) -> Callable[[], object]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def matmul_flops(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device = CPU) -> float:
    """Measured FLOP/s of ``(m x k) @ (k x n)`` in ``dtype`` on ``device`` (random operands)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    seconds = _time_op(lambda: torch.matmul(a, b), sync=_synchronizer(device))
    return 2.0 * m * k * n / seconds


def memory_bandwidth(num_bytes: int | None = None, device: torch.device = CPU) -> float:
    """Measured bytes/s of a large tensor copy on ``device`` (read + write counted).

    num_bytes: the tensor's size; by default 256 MiB on a CPU and 2 GiB on a GPU, whose
    last-level cache is larger (50 MB and more).
    """
    if num_bytes is None:
        num_bytes = 2 * 1024**3 if device.type == "cuda" else 256 * 1024**2
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _time_op(lambda: dst.copy_(src), sync=_synchronizer(device))
    return 2.0 * num_bytes / seconds


@dataclass(frozen=True)
class Roofline:
    """Ceilings measured on this machine (``device``).

    ``matmul_flops`` and ``model_shape_flops`` are in ``dtype``, the dtype the
    engine computes in (on a CPU without bf16 units that is float32, and bf16
    matmuls there run far below it); both dtypes' square figures are kept
    for the record.
    """

    dtype: str
    matmul_flops: float  # large square matmul (square_size^3) in dtype
    model_shape_flops: float  # (batch_rows x hidden) @ (hidden x 2 intermediate) in dtype
    bf16_matmul_flops: float  # square, bf16_size^3
    bf16_size: int
    fp32_matmul_flops: float  # square_size^3
    memory_bytes_per_s: float
    batch_rows: int
    square_size: int = 2048
    device: str = "cpu"


def arithmetic_dtype(compute_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine's matrix products run in, which sets its roofline.

    bf16 weights with float32 activations are multiplied in bf16 where the C
    kernels use bf16 dot-product instructions, and widened to float32 elsewhere.
    """
    if weight_dtype == torch.bfloat16 and compute_dtype == torch.float32:
        ops = native_ops()
        return torch.bfloat16 if ops is not None and ops.bf16_dot else torch.float32
    return compute_dtype


def baseline_dtype(engine: LLMEngine) -> torch.dtype:
    """The dtype transformers baselines run in: what kvserve's products run in.

    bf16 on CPUs with bf16 units (transformers' fastest there), float32 on
    the others, where PyTorch emulates bf16 far below float32's speed.
    """
    return arithmetic_dtype(engine.runner.dtype, engine.runner.weight_dtype)


def measure_roofline(
    arch: ArchConfig, batch_rows: int, dtype: torch.dtype, device: torch.device = CPU
) -> Roofline:
    """The ceilings of ``device``: square and model-shaped products, and copy bandwidth."""
    # A GPU needs larger products to reach its rate (8192^3: a few ms on an H100).
    square = 8192 if device.type == "cuda" else 2048
    # Without bf16 units PyTorch emulates bf16 matmuls (~0.2 GFLOP/s on the AVX2 machine):
    # a 2048^3 product would take over a minute per call, so a 256^3 one stands in.
    size = square if device.type == "cuda" or cpu_has_native_bf16() else 256
    bf16 = matmul_flops(size, size, size, torch.bfloat16, device)
    fp32 = matmul_flops(square, square, square, torch.float32, device)
    return Roofline(
        dtype=str(dtype).removeprefix("torch."),
        matmul_flops=bf16 if dtype == torch.bfloat16 else fp32,
        model_shape_flops=matmul_flops(
            batch_rows, arch.hidden_size, 2 * arch.intermediate_size, dtype, device
        ),
        bf16_matmul_flops=bf16,
        bf16_size=size,
        fp32_matmul_flops=fp32,
        memory_bytes_per_s=memory_bandwidth(device=device),
        batch_rows=batch_rows,
        square_size=square,
        device=str(device),
    )


def weight_count(arch: ArchConfig) -> int:
    """Weights of the matrix products in a forward pass per token: the decoder layers'
    and the LM head's (embedding lookups, norms and biases left out)."""
    return arch.num_hidden_layers * arch.layer_matmul_weights() + arch.vocab_size * arch.hidden_size


def flops_per_token(arch: ArchConfig, context_len: int, lm_head: bool = True) -> float:
    """FLOPs of one token: matmuls with the weights, attention over ``context_len`` keys
    (at most a sliding layer's window), and the LM head unless ``lm_head`` is False (a
    prompt token that does not sample)."""
    keys = 0
    for layer in range(arch.num_hidden_layers):
        window = arch.layer_sliding_window(layer)
        keys += context_len if window is None else min(context_len, window)
    attention = 4 * arch.num_attention_heads * arch.head_dim * keys
    weights = weight_count(arch) - (0 if lm_head else arch.vocab_size * arch.hidden_size)
    return 2.0 * weights + attention


def workload_flops(arch: ArchConfig, prompt_lens: list[int], output_lens: list[int]) -> float:
    """The model math a batch of requests needs, as the engine does it.

    Prompt tokens skip the LM head and attend to half their prompt on
    average; output tokens run the LM head and attend to the prompt plus half
    their output. (Prefix-cache hits would lower it; benchmarks start cold.)
    """
    return sum(
        p * flops_per_token(arch, p // 2, lm_head=False) + n * flops_per_token(arch, p + n // 2)
        for p, n in zip(prompt_lens, output_lens, strict=True)
    )


def weight_bytes(arch: ArchConfig, dtype: torch.dtype) -> int:
    """Bytes of weights a decode step must stream at least once."""
    return weight_count(arch) * torch.empty((), dtype=dtype).element_size()


def kv_read_bytes(arch: ArchConfig, context_lens: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of K and V a decode step must read at least once: each row's context (at most
    a sliding layer's window) in every layer, in the KV cache's ``dtype``."""
    per_key = (
        2 * arch.num_key_value_heads * arch.head_dim * torch.empty((), dtype=dtype).element_size()
    )
    keys = 0
    for layer in range(arch.num_hidden_layers):
        window = arch.layer_sliding_window(layer)
        keys += sum(c if window is None else min(c, window) for c in context_lens)
    return keys * per_key


def decode_step_floor_s(
    arch: ArchConfig,
    weight_dtype: torch.dtype,
    kv_bytes: float,
    memory_bytes_per_s: float,
) -> float:
    """The least time a decode step can take: its weight and KV bytes over the copy bandwidth."""
    return (weight_bytes(arch, weight_dtype) + kv_bytes) / memory_bytes_per_s


def decode_step_flops_per_s(arch: ArchConfig, steps: Sequence[DecodeStep], batch: int) -> float:
    """FLOP/s of the decode-only steps that ran ``batch`` rows (0.0 when there were none)."""
    full = [step for step in steps if len(step.context_lens) == batch]
    seconds = sum(step.seconds for step in full)
    if seconds == 0:
        return 0.0
    return sum(flops_per_token(arch, c) for step in full for c in step.context_lens) / seconds
