"""One fuzz case: build it from its index, load it as the engine does, report the outcome.

This side runs in the worker process (:func:`worker_main`), under the
address-space cap; :mod:`fuzz.model_file_fuzz` drives it from outside.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# The model is built with at most this many positions, as --max-model-len would
# cap it: its RoPE table is sized by the context length, which a file may set
# up to 2^24 (see docs/security.md).
MAX_POSITIONS = 4096


def load_model_files(path: Path) -> None:
    """Load the model at ``path`` as LLMEngine does, up to (not including) the KV pool."""
    import torch

    from kvserve.attention import get_attention_backend
    from kvserve.loader import CachedWeights, load_arch_config, load_tokenizer, resolve_model
    from kvserve.models.registry import build_model

    source = resolve_model(str(path))
    arch = load_arch_config(source)
    load_tokenizer(source)
    backend = get_attention_backend(
        "torch_paged",
        torch.float32,
        torch.device("cpu"),
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    max_position = min(arch.max_position_embeddings, MAX_POSITIONS)
    model = build_model(arch, max_position, torch.float32, backend)
    model.load_weights(CachedWeights(source, arch, torch.float32))


class CaseMaker:
    """Builds the base models once, then any case from its index (same seed, same case)."""

    def __init__(self, seed: int, work_dir: Path) -> None:
        from fuzz.model_file_bases import build_bases
        from gguf_bytes import parts_of

        self.seed = seed
        self.work_dir = work_dir
        self.bases = build_bases(work_dir / "bases")
        self.gguf_parts = {b.name: parts_of(b.path) for b in self.bases if b.kind == "gguf"}

    def make(self, index: int) -> tuple[str, str, Path]:
        """``(base name, mutation description, path to load)`` for case ``index``."""
        from fuzz.gguf_mutations import mutate_gguf
        from fuzz.hf_mutations import mutate_hf

        rng = random.Random(f"{self.seed}:{index}")
        base = rng.choice(self.bases)
        case_dir = self.case_dir(index)
        case_dir.mkdir(parents=True)
        if base.kind == "gguf":
            mutation, data = mutate_gguf(rng, self.gguf_parts[base.name])
            path = case_dir / "model.gguf"
            path.write_bytes(data)
        else:
            path = case_dir / "model"
            mutation = mutate_hf(rng, base.path, path)
        return base.name, mutation, path

    def case_dir(self, index: int) -> Path:
        return self.work_dir / f"case-{index}"


def run_case(maker: CaseMaker, index: int) -> dict[str, Any]:
    """One case's result: outcome ``ok``, ``ModelLoadError``, ``crash`` or ``harness``."""
    from kvserve.errors import ModelLoadError

    result: dict[str, Any] = {"index": index}
    try:
        result["base"], result["mutation"], path = maker.make(index)
    except Exception as exc:  # a bug of the fuzzer, not of kvserve: reported apart
        return {**result, "outcome": "harness", "detail": f"{type(exc).__name__}: {exc}"}
    start = time.perf_counter()
    try:
        load_model_files(path)
        result["outcome"] = "ok"
    except ModelLoadError as exc:
        field_name = getattr(exc, "field", None)  # kvserve before it named fields had none
        detail = "(no field)" if field_name is None else field_name or "''"
        result |= {"outcome": "ModelLoadError", "detail": detail, "message": str(exc)[:300]}
    except BaseException as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        result |= {
            "outcome": "crash",
            "detail": f"{type(exc).__name__}: {str(exc)[:300]} at {where.filename}:{where.lineno}",
        }
    finally:
        result["seconds"] = time.perf_counter() - start
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        shutil.rmtree(maker.case_dir(index), ignore_errors=True)
    return result


def worker_main(seed: int, memory_bound_mib: int) -> None:
    """Serve case indices from stdin, one JSON result per line on the original stdout."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the results
    # On a hang the parent sends SIGUSR1 first: the stack lands in the log it reports.
    faulthandler.register(signal.SIGUSR1)
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvserve-fuzz-") as work_dir:
        maker = CaseMaker(seed, Path(work_dir))
        for base in maker.bases:  # warm up: every lazy import happens before the cap
            load_model_files(base.path)
        _cap_address_space(memory_bound_mib)
        start_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results.write(f"ready {start_rss_mib:.0f}\n")
        for line in sys.stdin:
            results.write(json.dumps(run_case(maker, int(line))) + "\n")


def _cap_address_space(memory_bound_mib: int) -> None:
    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = (vm_kib + memory_bound_mib * 1024) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
