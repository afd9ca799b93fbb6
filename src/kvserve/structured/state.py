"""One sequence's place in its grammar: which tokens may come next, and advancing it.

The matcher has consumed exactly the sequence's output tokens so far. A
preempted sequence keeps its output tokens and its matcher; recomputing its
KV samples nothing until it has caught up, so the matcher is never fed a
token twice. Finishing or aborting drops the state (the engine sets the
request's ``grammar`` to None).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvserve.structured.compiler import CompiledGrammar, short_error

if TYPE_CHECKING:
    # Not at run time: ``import kvserve`` (SamplingParams) stays free of torch.
    import torch


class GrammarState:
    """The grammar of one sequence: compiling until :attr:`ready`, then a live matcher."""

    def __init__(self, compiled: Future[CompiledGrammar]) -> None:
        self._compiled = compiled
        self._matcher: Any = None
        self.num_tokens = 0  # the bitmask's width in tokens, known once started
        self._label = ""  # the spec's digest and length, for errors (never its text)

    @property
    def ready(self) -> bool:
        """True once the compile finished (successfully or not)."""
        return self._compiled.done()

    @property
    def compiled(self) -> Future[CompiledGrammar]:
        return self._compiled

    def start(self) -> None:
        """Take a matcher from the compiled grammar; raises the compile's error if it failed."""
        compiled = self._compiled.result()
        self.num_tokens = compiled.num_tokens
        self._label = compiled.label
        self._matcher = compiled.new_matcher()

    def fill_bitmask(self, bitmask_RW: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 bitmask [R, ceil(V/32)].

        ``bitmask_RW`` must be a contiguous int32 CPU tensor. Not through
        ``llguidance.torch``: in processes that imported it late (as a lazy
        import here would), mask fills measured 30x slower; the cause is not
        pinned down (that module wraps a function in ``torch.compile`` when imported).
        """
        import torch

        if bitmask_RW.dtype != torch.int32 or not bitmask_RW.is_contiguous() or bitmask_RW.is_cuda:
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        row_W = bitmask_RW[row]
        self._matcher.unsafe_compute_mask_ptr(row_W.data_ptr(), row_W.numel() * 4)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; raises ValueError if the grammar forbids it."""
        if not self._matcher.consume_token(token_id):
            raise ValueError(
                f"the grammar ({self._label}) does not allow token {token_id}: "
                f"{short_error(self._matcher.get_error())}"
            )

    @property
    def is_finished(self) -> bool:
        """True when the output is complete: the grammar allows no further token."""
        return bool(self._matcher.is_stopped())
