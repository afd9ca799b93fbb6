"""Benchmarks: kvserve against the tools people use instead, on the same workload."""
