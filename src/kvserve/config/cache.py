"""``CacheConfig``: the paged KV cache, and how big the pool is by default.

One of the groups :class:`~kvserve.config.engine.EngineConfig` holds. The
default budget's constants live here beside the fields they fill in; the
number of blocks that fits is computed by ``worker/kv_pool.py`` from them and
the loaded model, never written back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvserve.config.checks import require, require_positive_int
from kvserve.config.dtype import DTYPE_NAMES, DTypeName

# Which full blocks the prefix cache's disk tier writes (CacheConfig.prefix_cache_disk_write).
DiskWrite = Literal["prompt", "all"]
DISK_WRITES: tuple[DiskWrite, ...] = ("prompt", "all")

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

# The prefix cache's disk tier: its bound when only a folder is given, and the
# shortest run of blocks read back instead of recomputed. Reading a block of a
# small model's KV (well under a MiB) from the page cache takes far less than
# computing its tokens on a CPU, so one block is already worth loading.
DEFAULT_PREFIX_CACHE_DISK_BYTES = 4 * 1024**3
DEFAULT_DISK_MIN_BLOCKS = 1


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
    prefix_cache_dir: a folder for a second tier of the prefix cache, on
        disk: full blocks entering the prefix cache are also written there
        (behind the step; which ones, ``prefix_cache_disk_write`` says),
        named by their hashes under the model's identity, and read back
        instead of recomputed, also after a restart.
        Created private to the user (0700); refused when it belongs to
        someone else or others can write to it. Needs prefix caching on.
        None (the default): no disk tier.
    prefix_cache_disk_bytes: the disk tier's bound in bytes; the least
        recently used blocks are deleted past it. Defaults to 4 GiB when
        prefix_cache_dir is set.
    prefix_cache_disk_min_blocks: read a run of blocks back from disk only
        when at least this many consecutive blocks are there; shorter runs
        are recomputed.
    prefix_cache_disk_write: which full blocks the disk tier writes:
        ``"prompt"`` (the default) the blocks of a request's prompt, computed
        or taken from the pool (an answer is written when a later prompt
        resends it); ``"all"`` also the blocks its generated tokens fill, so
        that a conversation's last answer outlives a restart, at the cost of
        writing every decoded block.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    num_blocks: int | None = None
    kv_cache_dtype: DTypeName = "auto"
    enable_prefix_caching: bool | None = None
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int | None = None
    prefix_cache_disk_min_blocks: int = DEFAULT_DISK_MIN_BLOCKS
    prefix_cache_disk_write: DiskWrite = "prompt"

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
        self._check_disk_tier()
        if self.num_blocks is not None:
            # One block is the reserved null block; at least one more must hold data.
            require(
                isinstance(self.num_blocks, int) and self.num_blocks >= 2,
                "num_blocks",
                f"must be an integer >= 2, got {self.num_blocks!r}",
            )

    def _check_disk_tier(self) -> None:
        folder = self.prefix_cache_dir
        require(
            folder is None or (isinstance(folder, str) and folder.strip() != ""),
            "prefix_cache_dir",
            f"must be a folder path or None, got {folder!r}",
        )
        require(
            folder is None or self.enable_prefix_caching is not False,
            "prefix_cache_dir",
            "is a second tier of the prefix cache, which enable_prefix_caching=False turns "
            "off; leave enable_prefix_caching unset or pass True",
        )
        if self.prefix_cache_disk_bytes is not None:
            require_positive_int(self.prefix_cache_disk_bytes, "prefix_cache_disk_bytes")
            require(
                folder is not None,
                "prefix_cache_disk_bytes",
                "bounds the disk tier, which needs prefix_cache_dir set too",
            )
        require_positive_int(self.prefix_cache_disk_min_blocks, "prefix_cache_disk_min_blocks")
        require(
            self.prefix_cache_disk_write in DISK_WRITES,
            "prefix_cache_disk_write",
            f"must be one of {DISK_WRITES}, got {self.prefix_cache_disk_write!r}",
        )

    @property
    def disk_bytes(self) -> int:
        """The disk tier's bound: ``prefix_cache_disk_bytes`` or its default."""
        if self.prefix_cache_disk_bytes is None:
            return DEFAULT_PREFIX_CACHE_DISK_BYTES
        return self.prefix_cache_disk_bytes

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
        require(
            self.prefix_cache_dir is None,
            "prefix_cache_dir",
            "needs prefix caching, which models with sliding-window attention layers "
            "(Gemma 2, Gemma 3) run without; leave it unset",
        )
        return False
