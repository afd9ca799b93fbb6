"""What ranks 1..N-1 run: join the ranks, build their share of the model, follow rank 0's steps.

A worker rank has no scheduler, tokenizer or sampler. Each step it receives
the flat step inputs from rank 0 (see ``ModelRunner.execute``) and runs the
same forward pass on its share of the layers; the all-reduces inside keep its
hidden states equal to rank 0's, and its KV pool holds its KV heads of the
same blocks. A ``None`` from rank 0 ends the loop.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kvserve.config import EngineConfig
from kvserve.distributed.group import TensorParallelGroup
from kvserve.executor.rendezvous import join_ranks
from kvserve.loader import ModelSource
from kvserve.models.arch_config import ArchConfig
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def serve_steps(runner: ModelRunner) -> None:
    """Run rank 0's steps until it sends ``None`` or goes away between steps.

    Rank 0 may end without its stop message (a server killed by a signal skips
    the exit handlers): its closed connection then ends this loop too. A failure
    inside a step raises.
    """
    while True:
        try:
            inputs = runner.tp.broadcast_object(None)
        except RuntimeError as exc:
            logger.warning("rank 0 is gone (%s); rank %d stops", exc, runner.tp.rank)
            return
        if inputs is None:
            return
        with torch.inference_mode():
            runner.forward(inputs)


def run_worker_rank(
    tp: TensorParallelGroup,
    config: EngineConfig,
    source: ModelSource,
    arch: ArchConfig,
    max_model_len: int,
) -> None:
    """Build this rank's runner, follow the steps, then leave the process groups."""
    try:
        serve_steps(ModelRunner(config, source, arch, max_model_len, tp))
    finally:
        dist.destroy_process_group()


def spawned_worker_main(
    rank: int,
    size: int,
    store_port: int,
    config: EngineConfig,
    source: ModelSource,
    arch: ArchConfig,
    max_model_len: int,
) -> None:
    """The entry of a rank the engine spawned: rank 0's store is on loopback at ``store_port``."""
    tp = join_ranks(rank, size, "127.0.0.1", store_port, config.parallel_config)
    run_worker_rank(tp, config, source, arch, max_model_len)
