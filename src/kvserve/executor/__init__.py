"""Tensor-parallel ranks as processes: started and watched by rank 0, each running a model runner.

``launch`` (rank 0 starts or joins the other ranks and watches them),
``worker_loop`` (what ranks 1..N-1 run), ``rendezvous`` (how a rank joins the
process groups, which both sides do). The collectives themselves are
``distributed/group.py``, below the layers that call them. See
docs/tensor_parallel.md.
"""
