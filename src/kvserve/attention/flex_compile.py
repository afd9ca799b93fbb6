"""FlexAttention under ``torch.compile``, with its compiles counted and timed.

Without compiling, ``flex_attention`` materialises the scores of every query
against the whole pool; compiled, it becomes one fused kernel (C++ on CPU,
Triton on CUDA) that reads only the pages the ``BlockMask`` lists. One
compiled function serves every backend instance in the process, so engines
built one after another (tests, benchmark sweeps) compile each shape once.

Shapes are static (``dynamic=False``): a compile per attention-row bucket
(see ``flex_blocks.rows_bucket``), pool size, head shape and dtype; the
``mask_mod`` and ``score_mod`` closures a step builds anew are not recompiled
for, as long as their captured tensors keep their shapes. The count and the
time spent compiling are kept in :data:`COMPILE_STATS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import flex_attention

logger = logging.getLogger(__name__)

# Dynamo gives up compiling a function (and runs it uncompiled) after this many
# variants by default (8); row buckets times models in one process need more.
RECOMPILE_LIMIT = 64


@dataclass
class CompileStats:
    """Graphs compiled for FlexAttention in this process, and the seconds that took."""

    compiles: int = 0
    seconds: float = 0.0
    first_seconds: float = 0.0

    def describe(self) -> str | None:
        """A line for benchmark output; None when FlexAttention never compiled."""
        if not self.compiles:
            return None
        return (
            f"flex attention: {self.compiles} compiles ({self.seconds:.1f} s; the first "
            f"{self.first_seconds:.1f} s), one per attention-row bucket, pool size and variant"
        )


COMPILE_STATS = CompileStats()
_lock = threading.Lock()
_compiled: Callable[..., torch.Tensor] | None = None


def _counting_inductor(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Inductor, with every compile counted and timed (a compile is a new shape or variant)."""
    from torch._inductor.compile_fx import compile_fx

    start = time.perf_counter()
    compiled = compile_fx(graph, example_inputs)
    elapsed = time.perf_counter() - start
    if not COMPILE_STATS.compiles:
        COMPILE_STATS.first_seconds = elapsed
    COMPILE_STATS.compiles += 1
    COMPILE_STATS.seconds += elapsed
    logger.info(
        "flex attention: compile %d took %.1f s (%.1f s in all)",
        COMPILE_STATS.compiles,
        elapsed,
        COMPILE_STATS.seconds,
    )
    return compiled


def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """``flex_attention`` compiled once per process (shapes static, the whole call one graph)."""
    global _compiled
    with _lock:
        if _compiled is None:
            dynamo_config = torch._dynamo.config
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            _compiled = torch.compile(
                flex_attention, dynamic=False, fullgraph=True, backend=_counting_inductor
            )
        return _compiled
