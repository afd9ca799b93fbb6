"""The CUDA plan: bf16 on the GPU, FlexAttention, decode steps replayed as CUDA graphs.

``auto`` weights are bfloat16, which every GPU that runs this multiplies
natively, and the model computes in them. Decode-only steps are captured and
replayed per batch-size bucket (``worker/cuda_graphs.py``) when the backend
is FlexAttention and the engine was not asked to run eagerly.

Unverified on hardware: written and reviewed without a GPU (docs/cuda.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from kvserve.attention import FlexAttention
from kvserve.config import EngineConfig
from kvserve.config.dtype import resolve_dtype_name
from kvserve.distributed.group import TensorParallelGroup
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.loader.repacked_cache import RepackedCache
from kvserve.models.arch_config import ArchConfig
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.platform.plan import (
    AttentionPlan,
    DecodeFastPath,
    FastPathInputs,
    WeightPrecision,
    plan_attention,
)


class CudaPlan:
    """The device decisions of a run on one CUDA device."""

    def __init__(self, device: torch.device, config: EngineConfig, tp: TensorParallelGroup) -> None:
        self.device = device
        self.config = config
        self.tp = tp
        weight_dtype = getattr(
            torch, resolve_dtype_name(config.model_config.dtype, native_kernels=True)
        )
        self.weights = WeightPrecision(weight_dtype, weight_dtype)
        # No quantized kernels on the GPU: a GGUF file's quantized tensors are dequantized
        # to the model's dtype at load, whatever ModelConfig.quantization says.
        self.keep_quantized = False

    def attention(self, arch: ArchConfig, max_model_len: int) -> AttentionPlan:
        return plan_attention(self.config, self.device, self.weights, arch, self.tp, max_model_len)

    def prepare_weights(self, model: nn.Module, repacked: RepackedCache | None = None) -> None:
        """Nothing: PyTorch's GPU operators take the loaded weights as they are."""

    def decode_fast_path(self, inputs: FastPathInputs) -> DecodeFastPath | None:
        """CUDA graphs of decode steps, under FlexAttention unless ``enforce_eager``."""
        backend = inputs.backend
        if not isinstance(backend, FlexAttention) or self.config.model_config.enforce_eager:
            return None
        # A captured step must not read positions back to the host to grow a RoPE
        # table: each table is filled for every position up front.
        for module in inputs.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.tabulate_all()
        return DecodeGraphs(
            inputs.model,
            backend,
            inputs.num_blocks,
            inputs.max_num_seqs,
            self.device,
        )

    def argmax_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None

    def wait_for_device(self) -> float:
        """Wait for the step's queued work; the copy of sampled tokens to the host would wait
        for it anyway, and waiting here first separates that wait from the host's own time."""
        start = time.perf_counter()
        torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - start
