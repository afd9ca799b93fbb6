"""What a device plan decides for the model runner, and the decode fast path it may offer.

The runner asks one :class:`DevicePlan` (``cpu.py`` or ``cuda.py``, chosen
by :func:`~kvserve.worker.platform.device_plan`) for every decision that
depends on the device: the precisions, the attention backend, how the loaded
weights are stored and which kernels the layers call, the
:class:`DecodeFastPath` of decode-only steps, the sampler's argmax and how to
wait for the device. The runner itself holds no device branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from kvserve.attention import (
    AttentionBackend,
    AttentionLayout,
    FlexAttention,
    get_attention_backend,
)
from kvserve.config import EngineConfig
from kvserve.distributed.group import TensorParallelGroup
from kvserve.loader.repacked_cache import RepackedCache
from kvserve.models.arch_config import ArchConfig


class DecodeFastPath(Protocol):
    """Runs decode-only steps faster than the model's own forward, with the same numbers.

    The native decoder (the CPU's layers in one C call) and the CUDA graphs
    (one replay per batch-size bucket) are the two.
    """

    def applies(self, layouts: tuple[AttentionLayout, ...]) -> bool:
        """Whether this path takes the step of ``layouts`` (one per KV cache group), before
        the backend builds its metadata on them."""
        ...

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layouts: tuple[AttentionLayout, ...]
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` → the final hidden states ``[T, H]``, as ``model(...)``."""
        ...


@dataclass(frozen=True)
class Precision:
    """The three precisions of a run.

    weight_dtype: the linear weights'; dtype: the activations'; kv_cache_dtype:
    the KV pool's.
    """

    weight_dtype: torch.dtype
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype

    def describe(self) -> str:
        """E.g. ``float32``, or ``bfloat16 weights, float32 compute, bfloat16 KV cache``."""

        def name(dtype: torch.dtype) -> str:
            return str(dtype).removeprefix("torch.")

        if self.weight_dtype == self.dtype == self.kv_cache_dtype:
            return name(self.dtype)
        return (
            f"{name(self.weight_dtype)} weights, {name(self.dtype)} compute, "
            f"{name(self.kv_cache_dtype)} KV cache"
        )


class WeightPrecision(NamedTuple):
    """The precisions a plan decides before the attention backend: weights', activations'."""

    weight_dtype: torch.dtype
    dtype: torch.dtype


@dataclass(frozen=True)
class AttentionPlan:
    """The attention backend of a run and the precisions that go with it."""

    backend: AttentionBackend
    precision: Precision


@dataclass(frozen=True)
class FastPathInputs:
    """What a decode fast path is built from, once the KV pool is bound to the layers.

    num_blocks: pages in the KV pool.
    """

    model: nn.Module
    backend: AttentionBackend
    num_blocks: int
    max_num_seqs: int


class DevicePlan(Protocol):
    """Every device decision of the model runner, for one device."""

    device: torch.device
    # A GGUF file's quantized tensors stay in their blocks (else they are dequantized
    # to the model's dtype at load): see ModelConfig.quantization.
    keep_quantized: bool

    def attention(self, arch: ArchConfig, max_model_len: int) -> AttentionPlan:
        """The attention backend and the precisions of the weights, activations and KV pool."""
        ...

    def prepare_weights(self, model: nn.Module, repacked: RepackedCache | None = None) -> None:
        """Store the loaded weights in this device's fast format and give the layers their
        kernels: the one place after loading where the model's layers are changed.
        repacked: the model's cached quantized segments in the kernels' layout (a kept
        GGUF file's, when the cache is on)."""
        ...

    def decode_fast_path(self, inputs: FastPathInputs) -> DecodeFastPath | None:
        """The fast path of decode-only steps, or None where none applies."""
        ...

    def argmax_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The sampler's greedy argmax, when this device has a faster one than PyTorch's."""
        ...

    def wait_for_device(self) -> float:
        """Wait for the step's queued device work; returns the seconds waited."""
        ...


def plan_attention(
    config: EngineConfig,
    device: torch.device,
    weights: WeightPrecision,
    arch: ArchConfig,
    tp: TensorParallelGroup,
    max_model_len: int,
) -> AttentionPlan:
    """The configured attention backend for ``weights.dtype`` activations, and the KV pool's
    dtype (``auto``: the weights' dtype, except under FlexAttention); shared by the plans."""
    weight_dtype, dtype = weights
    block_size = config.cache_config.block_size
    backend = get_attention_backend(
        config.model_config.attention_backend,
        dtype,
        device,
        arch.num_attention_heads // tp.size,
        arch.num_key_value_heads // tp.size,
        arch.head_dim,
        max_blocks_per_seq=-(-max_model_len // block_size),
    )
    kv_name = config.cache_config.kv_cache_dtype
    kv_cache_dtype = weight_dtype if kv_name == "auto" else getattr(torch, kv_name)
    if isinstance(backend, FlexAttention) and kv_name == "auto":
        # FlexAttention computes in its inputs' one dtype: a pool narrower than the
        # activations would round all of attention to it, so the pool follows them.
        kv_cache_dtype = dtype
    return AttentionPlan(backend, Precision(weight_dtype, dtype, kv_cache_dtype))
