"""Benchmarks that drive kvserve's engine (and its baselines) in this process.

``kvserve bench throughput``, ``latency``, ``sweep``, ``chunked-prefill``,
``prefix`` and ``structured``: each builds an engine from the engine flags,
times it on a seeded workload from :mod:`kvserve.benchmarks.workloads`, and
prints a table (or writes JSON). ``engine_driver.py`` steps an engine and
times every step; ``roofline.py`` counts the FLOPs and bytes a workload needs.
"""
