"""Reading a server's metrics and resident memory from outside (kvserve bench soak, the fuzzer)."""

from __future__ import annotations

import os

from kvserve.benchmarks.online.server_probe import (
    BLOCKS_USED,
    metric_value,
    parse_vm_rss,
    read_rss_bytes,
)

METRICS = """\
# HELP kvserve_kv_cache_blocks_used KV cache blocks in use.
# TYPE kvserve_kv_cache_blocks_used gauge
kvserve_kv_cache_blocks_used{model_name="a"} 3.0
kvserve_kv_cache_blocks_used{model_name="b"} 2.0
kvserve_kv_cache_blocks_used_extra{model_name="a"} 100.0
kvserve_kv_cache_blocks_total{model_name="a"} 512.0
kvserve_num_requests_running 0
kvserve_broken{model_name="a"} not-a-number
"""


def test_a_metric_is_summed_over_its_label_sets_and_only_its_own() -> None:
    assert metric_value(METRICS, BLOCKS_USED) == 5.0
    assert metric_value(METRICS, "kvserve_kv_cache_blocks_total") == 512.0
    assert metric_value(METRICS, "kvserve_num_requests_running") == 0.0


def test_a_missing_or_unreadable_metric_is_none() -> None:
    assert metric_value(METRICS, "kvserve_num_requests_waiting") is None
    assert metric_value(METRICS, "kvserve_broken") is None
    assert metric_value("", BLOCKS_USED) is None


def test_vm_rss_is_read_in_bytes() -> None:
    status = "Name:\tpython\nVmPeak:\t  999 kB\nVmRSS:\t  123456 kB\nThreads:\t4\n"
    assert parse_vm_rss(status) == 123456 * 1024
    assert parse_vm_rss("Name:\tkthreadd\n") is None  # kernel threads have no VmRSS
    assert parse_vm_rss("VmRSS:\t12 MB\n") is None


def test_this_process_has_a_resident_size_and_a_dead_pid_none() -> None:
    rss = read_rss_bytes(os.getpid())
    assert rss is not None and rss > 1024 * 1024
    assert read_rss_bytes(2**22 + 12345) is None  # above Linux's largest pid
