"""Rank 0's side of tensor parallelism: start (or join) the other ranks, watch them, stop them.

Two ways to get ranks:

- **spawned by the engine** (the default): rank 0 opens a ``TCPStore`` on
  loopback, starts ranks 1..N-1 with the ``spawn`` start method (daemon
  processes: they never outlive an engine process that exits), waits until
  each has joined (a rank that dies while starting is reported at once, not
  after a timeout), then all ranks form the process groups;
- **started by torchrun** (``RANK`` and ``WORLD_SIZE`` in the environment):
  every process runs the same program; rank 0's engine goes on, while on the
  other ranks the engine's constructor runs the worker loop and then ends the
  process (``SystemExit(0)``) when rank 0 closes its engine.

A rank that dies makes the next collective fail at once (gloo sees the closed
connection); a rank that stops answering fails it after
``distributed_timeout_s``. Either way :class:`WorkerRanks` turns the failure
into a :class:`TensorParallelError` naming the rank, and every later step
raises it too: the ranks' KV pools no longer agree.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.config import EngineConfig
from kvserve.distributed.group import TensorParallelError, TensorParallelGroup
from kvserve.errors import InvalidParameterError
from kvserve.executor.rendezvous import JOINED_KEY, form_groups
from kvserve.executor.worker_loop import run_worker_rank, spawned_worker_main
from kvserve.loader import ModelSource
from kvserve.models.arch_config import ArchConfig
from kvserve.models.registry import check_tensor_parallel_size
from kvserve.worker.device import resolve_device

logger = logging.getLogger(__name__)

_POLL_S = 0.05
# How long spawned ranks may take to start (import torch, connect): a rank that dies
# while starting is reported at once, this only bounds one that never gets there.
_START_TIMEOUT_S = 600.0
# How long rank 0 gives its workers to leave after the stop message before ending them.
_STOP_TIMEOUT_S = 10.0

T = TypeVar("T")


class WorkerRanks:
    """Rank 0's handle on ranks 1..N-1: ``tp`` for its runner, ``run`` around each
    collective-bearing call, ``close`` to stop them. processes: the spawned ranks
    (empty under torchrun, whose agent owns the processes)."""

    def __init__(self, tp: TensorParallelGroup, processes: list[BaseProcess]) -> None:
        self.tp = tp
        self.processes = processes
        self.error: str | None = None
        self.closed = False

    def run(self, call: Callable[..., T], *args: object) -> T:
        """``call(*args)``; a collective failure becomes a TensorParallelError, now and after."""
        self.check()
        try:
            return call(*args)
        except RuntimeError as exc:
            raise self._failed(exc) from exc

    def check(self) -> None:
        """Raise TensorParallelError if a step failed before or a spawned rank has exited."""
        if self.error is None and self.exited():
            self.error = f"tensor-parallel {self.exited()}"
        if self.error is not None:
            raise TensorParallelError(self.error)

    def exited(self) -> str:
        """E.g. ``rank 1 exited (code -9)``; empty while every spawned rank runs."""
        return ", ".join(
            f"rank {rank} exited (code {process.exitcode})"
            for rank, process in enumerate(self.processes, start=1)
            if process.exitcode is not None
        )

    def _failed(self, exc: RuntimeError) -> TensorParallelError:
        # A rank that died is reaped a moment after its connections close: wait a
        # little, so that the message can name it.
        deadline = time.monotonic() + 1.0
        while not self.exited() and self.processes and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        cause = self.exited() or f"collective failed ({exc})"
        self.error = f"a tensor-parallel step failed: {cause}; the engine cannot run any more steps"
        logger.error("%s", self.error)
        return TensorParallelError(self.error)

    def close(self) -> None:
        """Stop the other ranks and leave the process groups; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.error is None:
            try:
                self.tp.broadcast_object(None)  # the workers' stop message
            except RuntimeError:
                logger.warning("a tensor-parallel rank was gone before the engine closed")
        for process in self.processes:
            # After a failed step a rank may be stuck in a collective: do not wait for it.
            process.join(_STOP_TIMEOUT_S if self.error is None else 0)
            if process.is_alive():
                process.kill()
                process.join(_STOP_TIMEOUT_S)
        dist.destroy_process_group()


def _torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or anything setting RANK and WORLD_SIZE) started us."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def start_tensor_parallel(
    config: EngineConfig, source: ModelSource, arch: ArchConfig, max_model_len: int
) -> WorkerRanks | None:
    """Rank 0's :class:`WorkerRanks`, or None with one rank.

    Checks ``tensor_parallel_size`` against the model (and torchrun's world)
    before any process starts. Under torchrun, on ranks other than 0 this
    runs the worker loop and raises ``SystemExit(0)`` when rank 0 closes.
    """
    parallel = config.parallel_config
    size = parallel.tensor_parallel_size
    torchrun = _torchrun_world()
    if torchrun is not None and torchrun[1] > 1 and torchrun[1] != size:
        raise InvalidParameterError(
            "tensor_parallel_size", f"must equal torchrun's WORLD_SIZE {torchrun[1]}, got {size}"
        )
    check_tensor_parallel_size(arch, size)
    if size == 1:
        return None
    if resolve_device(config.model_config.device).type != "cpu":
        # A CUDA version needs a device per rank, NCCL, and CUDA graphs that capture
        # the all-reduces; none of it is built (see docs/tensor_parallel.md).
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"must be 1 on {config.model_config.device!r}: tensor parallelism runs on the "
            f"CPU only (device cpu), got {size}",
        )
    if dist.is_initialized():
        raise InvalidParameterError(
            "tensor_parallel_size",
            "this process already belongs to a torch.distributed group (another "
            "tensor-parallel engine?); close it first: one tensor-parallel engine per process",
        )
    if torchrun is not None:
        tp = form_groups(torchrun[0], size, parallel)
        if tp.rank != 0:
            run_worker_rank(tp, config, source, arch, max_model_len)
            raise SystemExit(0)
        return WorkerRanks(tp, [])
    return _spawn_ranks(config, source, arch, max_model_len)


def _spawn_ranks(
    config: EngineConfig, source: ModelSource, arch: ArchConfig, max_model_len: int
) -> WorkerRanks:
    parallel = config.parallel_config
    size = parallel.tensor_parallel_size
    timeout = timedelta(seconds=parallel.distributed_timeout_s)
    # Port 0: the system picks a free one; the workers learn it from their arguments.
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=timeout
    )
    context = mp.get_context("spawn")
    processes: list[BaseProcess] = [
        context.Process(
            target=spawned_worker_main,
            args=(rank, size, store.port, config, source, arch, max_model_len),
            name=f"kvserve-tp-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for process in processes:
        process.start()
    ranks = WorkerRanks(TensorParallelGroup(0, size), processes)
    keys = [JOINED_KEY.format(rank=rank) for rank in range(1, size)]
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not store.check(keys):
        if ranks.exited() or time.monotonic() > deadline:
            for process in processes:
                process.kill()
            cause = ranks.exited() or f"not every rank joined in {_START_TIMEOUT_S} s"
            raise TensorParallelError(f"starting the tensor-parallel ranks failed: {cause}")
        time.sleep(_POLL_S)
    ranks.tp = form_groups(0, size, parallel, store)
    return ranks
