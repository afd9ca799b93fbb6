"""``ModelConfig``: which model to run, in which precision, on which device.

One of the groups :class:`~kvserve.config.engine.EngineConfig` holds; the
values that depend on the loaded model (its context length) are computed at
load time, never written back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kvserve.config.checks import require, require_positive_int
from kvserve.config.dtype import DTYPE_NAMES, DTypeName

# The one list of attention backend names (each backend class's ``name`` is one of them).
AttentionBackendName = Literal["auto", "torch_paged", "native_paged", "flex"]
ATTENTION_BACKENDS: tuple[AttentionBackendName, ...] = get_args(AttentionBackendName)
DeviceName = Literal["auto", "cpu", "cuda"]
# How linear weights are stored: see ModelConfig.quantization (vLLM's argument name).
QuantizationName = Literal["auto", "none", "q8_0", "q4_0", "q4_k"]
QUANTIZATIONS: tuple[QuantizationName, ...] = get_args(QuantizationName)
_DEVICES = ("auto", "cpu", "cuda")
# What the engine serves (vLLM's word): see ModelConfig.task.
TaskName = Literal["auto", "generate", "embed"]
TASKS: tuple[TaskName, ...] = get_args(TaskName)
# How embeddings are pooled: see ModelConfig.pooling_type.
PoolingTypeName = Literal["auto", "mean", "cls", "last"]
POOLING_TYPE_NAMES: tuple[PoolingTypeName, ...] = get_args(PoolingTypeName)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and in which precision.

    model: a Hugging Face folder (config.json + safetensors), a .gguf file, an
        alias such as ``smollm2-135m-instruct``, or a Hugging Face hub id such as
        ``Qwen/Qwen2.5-0.5B-Instruct`` (from the Hugging Face cache, downloaded
        into it unless HF_HUB_OFFLINE=1).
    dtype: the weights' precision. ``auto`` picks bfloat16 wherever kvserve's
        C kernels run (any CPU they build on) or the CPU has bf16 units, and
        float32 otherwise. With the C kernels, bfloat16 weights are
        multiplied with float32 activations (AVX512-BF16 dot products where
        the CPU has them, widened to float32 elsewhere): half the bytes for
        decode to stream. ``float32`` is exact (parity tests).
    max_model_len: the longest sequence (prompt + output) accepted; None means
        the model's own context length.
    seed: seeds the random draws of requests that have no seed of their own.
    attention_backend: ``auto`` uses FlexAttention on CUDA; on CPU the C
        kernels that read the paged KV cache in place where they apply
        (float32 activations), ``torch_paged`` otherwise. ``flex``
        (FlexAttention over the page pool, compiled on first use) can be
        forced on either device.
    revision: the branch, tag or commit of a hub id model (default: main).
    device: where the model, KV cache and sampler run: ``cpu``, ``cuda``, or
        ``auto`` (CUDA when PyTorch sees a GPU). The CUDA path is verified on
        an H200 (docs/cuda.md).
    enforce_eager: on CUDA, run decode steps eagerly instead of replaying
        CUDA graphs captured per batch-size bucket.
    quantization: how linear weights are stored and multiplied. ``auto``: a
        GGUF file's quantized tensors stay in their formats (Q8_0, Q4_0, Q4_1,
        Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), multiplied by the C kernels without
        dequantizing them; other weights are held in ``dtype``. ``none``:
        everything is dequantized to ``dtype`` at load. ``q8_0``, ``q4_0``,
        ``q4_k``: the linear weights and token embeddings of any checkpoint
        are quantized to that format at load (round to nearest per block);
        CPU only, on one rank.
    task: ``generate`` (text), or ``embed``: the engine also takes embedding
        requests, pooled from the last hidden states (a decoder keeps
        generating beside them; an encoder such as BERT only embeds).
        ``auto``: ``embed`` for encoders, ``generate`` otherwise.
    pooling_type: how an embedding is pooled: ``mean``, ``cls`` (first token)
        or ``last`` token. ``auto``: what the model folder's
        sentence-transformers files say, else ``last`` for a decoder and
        ``cls`` for an encoder. Vectors are normalised unless the folder's
        modules leave the ``Normalize`` module out.
    """

    model: str = "smollm2-135m-instruct"
    dtype: DTypeName = "auto"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: AttentionBackendName = "auto"
    revision: str | None = None
    device: DeviceName = "auto"
    enforce_eager: bool = False
    quantization: QuantizationName = "auto"
    task: TaskName = "auto"
    pooling_type: PoolingTypeName = "auto"

    def __post_init__(self) -> None:
        require(
            isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string"
        )
        if self.revision is not None:
            require(
                isinstance(self.revision, str) and bool(self.revision.strip()),
                "revision",
                f"must be a non-empty string (a branch, tag or commit), got {self.revision!r}",
            )
        require(
            self.dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}, got {self.dtype!r}"
        )
        if self.max_model_len is not None:
            require_positive_int(self.max_model_len, "max_model_len")
        require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            "seed",
            f"must be an integer, got {self.seed!r}",
        )
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        require(
            self.device in _DEVICES, "device", f"must be one of {_DEVICES}, got {self.device!r}"
        )
        require(
            self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        require(
            self.device != "cuda" or self.quantization in ("auto", "none"),
            "quantization",
            f"{self.quantization!r} quantizes weights for kvserve's CPU kernels; with "
            f"device='cuda' it must be one of ('auto', 'none')",
        )
        require(self.task in TASKS, "task", f"must be one of {TASKS}, got {self.task!r}")
        require(
            self.pooling_type in POOLING_TYPE_NAMES,
            "pooling_type",
            f"must be one of {POOLING_TYPE_NAMES}, got {self.pooling_type!r}",
        )
        require(
            isinstance(self.enforce_eager, bool),
            "enforce_eager",
            f"must be True or False, got {self.enforce_eager!r}",
        )
