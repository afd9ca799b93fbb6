"""Tensor parallelism over ``torch.distributed``: the ranks, their collectives, their start.

``group`` (the collectives one rank sees), ``launch`` (rank 0 starts or joins
the other ranks and watches them), ``worker_loop`` (what ranks 1..N-1 run).
See docs/tensor_parallel.md.
"""
