"""``ParallelConfig``: the processes (tensor-parallel ranks) and threads that run the model.

One of the groups :class:`~kvserve.config.engine.EngineConfig` holds; the
ranks are started from it by ``executor/launch.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.checks import require, require_positive_int


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
        require_positive_int(self.tensor_parallel_size, "tensor_parallel_size")
        if self.num_threads is not None:
            require_positive_int(self.num_threads, "num_threads")
        timeout = self.distributed_timeout_s
        require(
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0,
            "distributed_timeout_s",
            f"must be a positive number of seconds, got {timeout!r}",
        )
