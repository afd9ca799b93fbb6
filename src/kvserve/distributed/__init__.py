"""Tensor parallelism's process groups: one rank's place among the ranks, and its collectives.

``group`` is all the layers and models need. Starting the ranks, which builds
models and model runners, is ``executor/``, a floor above. See
docs/tensor_parallel.md.
"""
