"""How a rank joins the process groups: rank 0 and the spawned ranks both come through here.

Rank 0's store (a ``TCPStore`` on loopback) learns that each spawned rank has
joined before any of them forms a group, so a rank that dies while starting is
seen at once (``launch.py``); under torchrun, ``env://`` replaces the store.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from kvserve.config import ParallelConfig
from kvserve.distributed.group import TensorParallelGroup

# Workers wait between steps for as long as the engine idles (see distributed/group.py).
_IDLE_TIMEOUT = timedelta(days=365)
JOINED_KEY = "kvserve/joined/{rank}"


def form_groups(
    rank: int, size: int, parallel: ParallelConfig, store: dist.Store | None = None
) -> TensorParallelGroup:
    """Join the default process group (``store``, or torchrun's ``env://``) and the control group."""
    timeout = timedelta(seconds=parallel.distributed_timeout_s)
    if store is None:
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallelGroup(rank, size, dist.group.WORLD, control)


def join_ranks(
    rank: int, size: int, host: str, port: int, parallel: ParallelConfig
) -> TensorParallelGroup:
    """A spawned worker's start: say it joined in rank 0's store, then form the groups."""
    timeout = timedelta(seconds=parallel.distributed_timeout_s)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    store.set(JOINED_KEY.format(rank=rank), "1")
    return form_groups(rank, size, parallel, store)
