"""One process's place among the ranks that split a model: its rank, and the collectives.

Two process groups join the same ranks:

- the *device group* carries the all-reduces inside the forward pass (gloo:
  tensor parallelism runs on the CPU), with the engine's
  ``distributed_timeout_s``: a rank that stops answering in the middle of a
  step fails the step instead of hanging it;
- the *control group* (gloo, on the CPU) carries each step's inputs from
  rank 0 to the others. Workers wait on it between steps, for as long as the
  engine stays idle, so it has no practical timeout; a rank that dies still
  ends every wait at once, because gloo sees the closed connection. (A gloo
  send waits for the receiver to post its receive: a worker that is alive but
  frozen between steps would hold rank 0's next send. One that freezes in a
  step fails that step's all-reduce after the timeout.)
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed: the engine's ranks no longer agree, no step can run."""


@dataclass(frozen=True, eq=False)
class TensorParallelGroup:
    """rank, size: this process's rank among ``size`` ranks (``size`` 1: no other rank,
    every collective is a no-op). device_group, control_group: see the module docstring;
    None when ``size`` is 1."""

    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable), on every rank; other ranks pass anything (ignored).

        Two broadcasts on the control group: the pickle's length, then its bytes
        (tensors inside travel in the pickle, so this is for small step inputs).
        """
        if self.size == 1:
            return obj
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.long)
        else:
            length = torch.zeros(1, dtype=torch.long)
        dist.broadcast(length, src=0, group=self.control_group)
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control_group)
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())


SINGLE_RANK = TensorParallelGroup()
