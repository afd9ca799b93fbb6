"""``CacheConfig``: the paged KV cache, and how big the pool is by default.

One of the groups :class:`~kvserve.config.engine.EngineConfig` holds. The
default budget's constants live here beside the fields they fill in; the
number of blocks that fits is computed by ``worker/kv_pool.py`` from them and
the loaded model, never written back.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.checks import require, require_positive_int
from kvserve.config.dtype import DTYPE_NAMES, DTypeName

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
        require_positive_int(self.block_size, "block_size")
        require(
            self.kv_cache_dtype in DTYPE_NAMES,
            "kv_cache_dtype",
            f"must be one of {DTYPE_NAMES}, got {self.kv_cache_dtype!r}",
        )
        require(
            self.enable_prefix_caching is None or isinstance(self.enable_prefix_caching, bool),
            "enable_prefix_caching",
            f"must be True, False or None (auto), got {self.enable_prefix_caching!r}",
        )
        if self.kv_cache_memory_bytes is not None:
            require_positive_int(self.kv_cache_memory_bytes, "kv_cache_memory_bytes")
        if self.kv_cache_memory_fraction is not None:
            fraction = self.kv_cache_memory_fraction
            require(
                isinstance(fraction, (int, float)) and 0.0 < fraction <= 0.9,
                "kv_cache_memory_fraction",
                f"must be in (0, 0.9], got {fraction!r}",
            )
        if self.num_blocks is not None:
            # One block is the reserved null block; at least one more must hold data.
            require(
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
        require(
            self.enable_prefix_caching is not True,
            "enable_prefix_caching",
            "is not supported for models with sliding-window attention layers "
            "(Gemma 2, Gemma 3); leave it unset or pass False",
        )
        return False
