"""Engine configuration: frozen dataclasses, validated on construction.

Values that depend on the loaded model or on the machine (the model's context
length, the number of KV blocks that fit the budget, the dtype ``auto`` picks)
are computed by functions and returned, never written back into a config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.errors import InvalidParameterError

DTypeName = Literal["auto", "float32", "bfloat16"]
_DTYPES = ("auto", "float32", "bfloat16")
SchedulingPolicy = Literal["fcfs", "priority"]
AttentionBackendName = Literal["auto", "torch_paged", "native_paged", "flex"]
_ATTENTION_BACKENDS = ("auto", "torch_paged", "native_paged", "flex")
DeviceName = Literal["auto", "cpu", "cuda"]
_DEVICES = ("auto", "cpu", "cuda")
_POLICIES = ("fcfs", "priority")

# Default KV budget on a CPU box: a fifth of the memory available at start-up,
# at most 4 GiB. Unlike a GPU, the host also holds the weights, the OS and the
# user's other programs, so a GPU-style "90% of memory" would be hostile.
DEFAULT_KV_CACHE_FRACTION = 0.2
DEFAULT_KV_CACHE_CAP_BYTES = 4 * 1024**3

# Within that budget the default pool holds max_num_seqs sequences of this many
# tokens (fewer when max_model_len is shorter), and at least one sequence of
# max_model_len tokens. 512 covers the work kvserve is run with: chat turns and
# the demo's answers (a few hundred tokens), and the benchmark workloads
# (prompts of 64-512 tokens plus up to 256 generated: 128 such requests at once
# peak near 42k tokens, under 128 x 512 = 64k). Longer sequences are not
# refused: past the pool the scheduler preempts, and on a CPU running fewer
# sequences at once costs little throughput (decode at 16 concurrent sequences
# already reaches ~95% of the 64-sequence throughput, docs/benchmarks.md).
DEFAULT_EXPECTED_SEQ_TOKENS = 512


def _require(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidParameterError(param, message)


def _positive_int(value: object, param: str) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        param,
        f"must be a positive integer, got {value!r}",
    )


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
        ``auto`` (CUDA when PyTorch sees a GPU). The CUDA path is unverified on
        hardware (docs/cuda.md).
    enforce_eager: on CUDA, run decode steps eagerly instead of replaying
        CUDA graphs captured per batch-size bucket.
    """

    model: str = "smollm2-135m-instruct"
    dtype: DTypeName = "auto"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: AttentionBackendName = "auto"
    revision: str | None = None
    device: DeviceName = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _require(
            isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string"
        )
        if self.revision is not None:
            _require(
                isinstance(self.revision, str) and bool(self.revision.strip()),
                "revision",
                f"must be a non-empty string (a branch, tag or commit), got {self.revision!r}",
            )
        _require(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None:
            _positive_int(self.max_model_len, "max_model_len")
        _require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            "seed",
            f"must be an integer, got {self.seed!r}",
        )
        _require(
            self.attention_backend in _ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _require(
            self.device in _DEVICES, "device", f"must be one of {_DEVICES}, got {self.device!r}"
        )
        _require(
            isinstance(self.enforce_eager, bool),
            "enforce_eager",
            f"must be True or False, got {self.enforce_eager!r}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    block_size: tokens per KV block.
    kv_cache_memory_bytes: the KV pool's size in bytes; takes precedence over
        the fraction.
    kv_cache_memory_fraction: the KV pool's size as a fraction of the memory
        available at start-up. With neither set, enough for ``max_num_seqs``
        sequences of ``min(max_model_len, DEFAULT_EXPECTED_SEQ_TOKENS)``
        tokens and at least one of ``max_model_len`` tokens, within a fifth of
        available memory and at most 4 GiB.
    num_blocks: use exactly this many blocks (tests and experiments).
    kv_cache_dtype: the KV pool's precision: ``auto`` follows the weights'
        dtype; ``float32`` or ``bfloat16`` force one. A bfloat16 pool holds
        twice the tokens per byte and halves what decode attention reads.
    enable_prefix_caching: keep the K/V of full blocks after their request
        ends, keyed by a hash of the whole prefix (and the request's
        ``cache_salt``), so later requests that start with the same tokens
        skip computing them. Freed cached blocks are evicted least recently
        used first. None (the default) turns it on for every model without
        sliding-window layers (Gemma 2 and 3 have them; they run without it,
        and True is refused for them). See docs/prefix_caching.md.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    num_blocks: int | None = None
    kv_cache_dtype: DTypeName = "auto"
    enable_prefix_caching: bool | None = None

    def __post_init__(self) -> None:
        _positive_int(self.block_size, "block_size")
        _require(
            self.kv_cache_dtype in _DTYPES,
            "kv_cache_dtype",
            f"must be one of {_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _require(
            self.enable_prefix_caching is None or isinstance(self.enable_prefix_caching, bool),
            "enable_prefix_caching",
            f"must be True, False or None (auto), got {self.enable_prefix_caching!r}",
        )
        if self.kv_cache_memory_bytes is not None:
            _positive_int(self.kv_cache_memory_bytes, "kv_cache_memory_bytes")
        if self.kv_cache_memory_fraction is not None:
            fraction = self.kv_cache_memory_fraction
            _require(
                isinstance(fraction, (int, float)) and 0.0 < fraction <= 0.9,
                "kv_cache_memory_fraction",
                f"must be in (0, 0.9], got {fraction!r}",
            )
        if self.num_blocks is not None:
            # One block is the reserved null block; at least one more must hold data.
            _require(
                isinstance(self.num_blocks, int) and self.num_blocks >= 2,
                "num_blocks",
                f"must be an integer >= 2, got {self.num_blocks!r}",
            )

    def prefix_caching_for(self, has_sliding_window: bool) -> bool:
        """Whether prefix caching runs for a model with or without sliding-window layers.

        The KV cache frees sliding layers' blocks as they leave the window and
        keeps no cache for them, so such models run without prefix caching;
        asking for it explicitly is an error rather than a silent no.
        """
        if not has_sliding_window:
            return self.enable_prefix_caching is not False
        _require(
            self.enable_prefix_caching is not True,
            "enable_prefix_caching",
            "is not supported for models with sliding-window attention layers "
            "(Gemma 2, Gemma 3); leave it unset or pass False",
        )
        return False


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    max_num_batched_tokens: tokens (decode tokens plus prefill chunks) in one
        forward pass.
    max_num_seqs: requests in one forward pass.
    enable_chunked_prefill: split long prompts across steps so decodes keep
        flowing; when off, a prompt is prefilled whole in one step.
    max_prefill_tokens_while_decoding: in a step that also decodes, prompt
        chunks (of more than one token) take at most this many tokens together, so that a new prompt
        does not stall the streams already generating (a step with nothing to
        decode still uses all of max_num_batched_tokens). None (offline runs):
        no cap; ``kvserve serve`` uses 96. Applies with chunked prefill only.
    policy: ``fcfs`` serves requests in arrival order and, when blocks run
        out, preempts the newest running request. ``priority`` serves the
        lowest per-request ``priority`` value first (ties in arrival order)
        and preempts the running request with the largest value (ties: the
        newest), also to admit a waiting request of higher priority.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    max_prefill_tokens_while_decoding: int | None = None
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        _positive_int(self.max_num_batched_tokens, "max_num_batched_tokens")
        _positive_int(self.max_num_seqs, "max_num_seqs")
        if self.max_prefill_tokens_while_decoding is not None:
            _positive_int(
                self.max_prefill_tokens_while_decoding, "max_prefill_tokens_while_decoding"
            )
        # Every running request must be able to decode in every step, or some would starve.
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"must be at least max_num_seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}",
        )
        _require(
            self.policy in _POLICIES,
            "policy",
            f"must be one of {_POLICIES}, got {self.policy!r}",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run the model, and how many threads each uses.

    tensor_parallel_size: processes (ranks) that split every layer's attention
        heads and MLP columns among them (see docs/tensor_parallel.md). Must
        divide the model's attention and KV heads. The engine starts the ranks
        itself, or joins those torchrun started.
    num_threads: PyTorch threads per rank; None shares the physical cores
        evenly among the ranks (at least one each).
    distributed_timeout_s: how long a rank waits in one collective of a step
        (an all-reduce) for the others before the step fails.
    """

    tensor_parallel_size: int = 1
    num_threads: int | None = None
    distributed_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _positive_int(self.tensor_parallel_size, "tensor_parallel_size")
        if self.num_threads is not None:
            _positive_int(self.num_threads, "num_threads")
        timeout = self.distributed_timeout_s
        _require(
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0,
            "distributed_timeout_s",
            f"must be a positive number of seconds, got {timeout!r}",
        )


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events: blocks entering and leaving the prefix cache (docs/kv_events.md).

    enable_kv_cache_events: collect each step's events for in-process readers
        (LLMEngine.take_kv_events); implied by kv_events_endpoint.
    kv_events_endpoint: publish each step's events on a ZMQ PUB socket bound
        here (such as tcp://*:5557), in vLLM's wire format; needs the
        kv-events extra. Unset: nothing is published.
    kv_events_replay_endpoint: a ZMQ ROUTER socket bound here resends the
        last kv_events_buffer_steps batches to subscribers that missed some.
    kv_events_topic: the topic frame of every published message.
    kv_events_buffer_steps: batches kept for replay, and for take_kv_events
        (the oldest are dropped when nobody takes them).
    kv_events_hwm: ZMQ high-water mark: messages queued per subscriber
        before the socket drops new ones.
    """

    enable_kv_cache_events: bool = False
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000

    def __post_init__(self) -> None:
        _require(
            isinstance(self.enable_kv_cache_events, bool),
            "enable_kv_cache_events",
            f"must be True or False, got {self.enable_kv_cache_events!r}",
        )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, str) and "://" in value),
                name,
                f"must be a ZMQ endpoint such as tcp://*:5557, got {value!r}",
            )
        _require(
            self.kv_events_replay_endpoint is None or self.kv_events_endpoint is not None,
            "kv_events_replay_endpoint",
            "replays published batches, so it needs kv_events_endpoint too",
        )
        _require(
            isinstance(self.kv_events_topic, str),
            "kv_events_topic",
            f"must be a string, got {self.kv_events_topic!r}",
        )
        _positive_int(self.kv_events_buffer_steps, "kv_events_buffer_steps")
        _positive_int(self.kv_events_hwm, "kv_events_hwm")

    @property
    def collects_events(self) -> bool:
        """Whether the engine collects events at all (off: the pool builds none)."""
        return self.enable_kv_cache_events or self.kv_events_endpoint is not None


ENGINE_CONFIG_GROUPS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, KVEventsConfig)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)

    @classmethod
    def from_kwargs(cls, model: str, **engine_args: Any) -> EngineConfig:
        """Build from flat keyword arguments named like the config fields (vLLM style).

        ``EngineConfig.from_kwargs("smollm2-135m-instruct", block_size=32, dtype="float32")``.
        An unknown name raises, naming it.
        """
        groups: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}}
        owners = {
            f.name: group for group in ENGINE_CONFIG_GROUPS for f in dataclasses.fields(group)
        }
        for name, value in engine_args.items():
            owner = owners.get(name)
            if owner is None or name == "model":
                allowed = ", ".join(sorted(n for n in owners if n != "model"))
                raise InvalidParameterError(name, f"is not an engine argument; known: {allowed}")
            groups.setdefault(owner, {})[name] = value
        return cls(
            model_config=ModelConfig(**groups[ModelConfig]),
            cache_config=CacheConfig(**groups.get(CacheConfig, {})),
            scheduler_config=SchedulerConfig(**groups.get(SchedulerConfig, {})),
            parallel_config=ParallelConfig(**groups.get(ParallelConfig, {})),
            kv_events_config=KVEventsConfig(**groups.get(KVEventsConfig, {})),
        )


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX-BF16 (Linux /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype_name(dtype: DTypeName, native_kernels: bool) -> Literal["float32", "bfloat16"]:
    """The concrete weight dtype ``auto`` stands for on this machine.

    native_kernels: kvserve's C kernels are built; they multiply bfloat16
    weights on any CPU, so bfloat16 is then the fast choice everywhere.
    """
    if dtype == "auto":
        return "bfloat16" if native_kernels or cpu_has_native_bf16() else "float32"
    return dtype
