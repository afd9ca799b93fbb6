"""llama.cpp's batched decoding through llama-cpp-python's low-level API: the throughput baseline.

As llama.cpp's ``batched`` example and its server do it: every sequence has
its own sequence id; a step is one ``llama_decode`` holding one token of
every live sequence and the whole prompts of the sequences admitted in that
step (llama.cpp splits it into micro-batches itself); the next token of each
sequence is the argmax (numpy) of its row of ``llama_get_logits_ith``. At
most ``max_live`` sequences run at a time, like kvserve's ``max_num_seqs``:
a finished sequence gives its KV cells and its id to the next waiting prompt.
EOS is ignored, every sequence runs to its output length.

Each sequence gets its own KV stream (``kv_unified`` off, each stream as
long as the longest sequence): with one unified stream every token's
attention would scan every sequence's cells, masked, which is not how
anyone would run this. A step takes whole prompts while its tokens fit in
``n_batch`` (2048, llama.cpp's server default, or more when a single prompt
needs it), and at least one prompt whenever a sequence id is free.

Times are recorded as :func:`kvserve.benchmarks.offline.engine_driver.drive` records
kvserve's, in the same :class:`~kvserve.benchmarks.timings.DriveResult`, so every figure derived from it
(tok/s, ms/token per sequence, TTFT, decode-step FLOP/s) means the same thing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np

from kvserve.benchmarks.baselines.llamacpp_baseline import LlamaCppSetup, import_llama_cpp
from kvserve.benchmarks.common import Metrics
from kvserve.benchmarks.timings import DecodeStep, DriveResult, RequestTrace

DEFAULT_BATCH_TOKENS = 2048  # llama.cpp server's default n_batch
UBATCH_TOKENS = 512  # llama.cpp's default n_ubatch
KV_CELL_ALIGNMENT = 256  # llama.cpp pads each sequence's context to this


def max_parallel_sequences() -> int:
    """How many sequence ids one llama.cpp context can hold (``LLAMA_MAX_SEQ``)."""
    return int(import_llama_cpp().llama_max_parallel_sequences())


@dataclass
class _LiveSequence:
    """A sequence being decoded: which request, its id, the next input token and its position."""

    index: int
    seq_id: int
    next_token: int
    next_position: int


class BatchedRun(NamedTuple):
    """A batched run's timings (as kvserve's driver records them) and each request's tokens."""

    result: DriveResult
    output_token_ids: list[list[int]]


class BatchedDecoder:
    """A llama.cpp model and context sized for a workload (use as a context manager).

    max_live: sequences decoded at once (at most :func:`max_parallel_sequences`).
    max_sequence_tokens: the longest prompt plus output the workload holds.
    max_prompt_tokens: the longest prompt.
    """

    def __init__(
        self,
        setup: LlamaCppSetup,
        max_live: int,
        max_sequence_tokens: int,
        max_prompt_tokens: int,
    ) -> None:
        llama_cpp = self._llama_cpp = import_llama_cpp()
        limit = max_parallel_sequences()
        if not 1 <= max_live <= limit:
            raise ValueError(f"max_live must be in [1, {limit}], got {max_live}")
        self.max_live = max_live
        self.batch_tokens = max(DEFAULT_BATCH_TOKENS, max_live + max_prompt_tokens)
        cells_per_sequence = -(-max_sequence_tokens // KV_CELL_ALIGNMENT) * KV_CELL_ALIGNMENT
        self._model: Any = None
        self._context: Any = None
        self._batch: Any = None
        llama_cpp.llama_backend_init()
        self._model = llama_cpp.llama_model_load_from_file(
            str(setup.model_file).encode(), llama_cpp.llama_model_default_params()
        )
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {setup.model_file}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_live * cells_per_sequence
        params.n_batch = self.batch_tokens
        params.n_ubatch = UBATCH_TOKENS
        params.n_seq_max = max_live
        params.kv_unified = False
        params.n_threads = setup.threads
        params.n_threads_batch = setup.threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self._context = llama_cpp.llama_init_from_model(self._model, params)
        if not self._context:
            self.close()
            raise RuntimeError("llama.cpp could not create a context for the workload")
        self._batch = llama_cpp.llama_batch_init(self.batch_tokens, 0, 1)
        self._memory = llama_cpp.llama_get_memory(self._context)
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))

    def run(self, prompts: Sequence[list[int]], output_lens: Sequence[int]) -> BatchedRun:
        """Decode every prompt to its exact output length, greedily, from an empty KV cache."""
        llama_cpp = self._llama_cpp
        llama_cpp.llama_memory_clear(self._memory, True)
        waiting = deque(range(len(prompts)))
        free_ids = list(reversed(range(self.max_live)))
        live: list[_LiveSequence] = []
        outputs: list[list[int]] = [[] for _ in prompts]
        decode_steps: list[DecodeStep] = []
        num_steps = 0
        start = time.perf_counter()
        traces = [RequestTrace(start) for _ in prompts]
        while waiting or live:
            # One row per live sequence, then whole prompts; ``sampled`` pairs a sequence with
            # the batch row whose logits give its next token.
            sampled: list[tuple[_LiveSequence, int]] = []
            contexts = []
            num_tokens = 0
            for sequence in live:
                self._set_token(num_tokens, sequence, logits=True)
                sampled.append((sequence, num_tokens))
                # The input at position p attends to p + 1 keys, itself included.
                contexts.append(sequence.next_position + 1)
                num_tokens += 1
            admitted = 0
            while waiting and free_ids:
                prompt = prompts[waiting[0]]
                if admitted and num_tokens + len(prompt) > self.batch_tokens:
                    break
                sequence = _LiveSequence(waiting.popleft(), free_ids.pop(), prompt[0], 0)
                for position, token in enumerate(prompt):
                    sequence.next_token, sequence.next_position = token, position
                    self._set_token(num_tokens, sequence, logits=position == len(prompt) - 1)
                    num_tokens += 1
                sampled.append((sequence, num_tokens - 1))
                live.append(sequence)
                admitted += 1
            self._batch.n_tokens = num_tokens
            before = time.perf_counter()
            status = llama_cpp.llama_decode(self._context, self._batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status}")
            next_tokens = [self._argmax(row) for _, row in sampled]
            now = time.perf_counter()
            if not admitted:
                decode_steps.append(DecodeStep(now - before, contexts))
            num_steps += 1
            for (sequence, _), token in zip(sampled, next_tokens, strict=True):
                traces[sequence.index].token_times.append(now)
                outputs[sequence.index].append(token)
                sequence.next_token = token
                sequence.next_position += 1
                if len(outputs[sequence.index]) == output_lens[sequence.index]:
                    llama_cpp.llama_memory_seq_rm(self._memory, sequence.seq_id, -1, -1)
                    free_ids.append(sequence.seq_id)
                    live.remove(sequence)
        wall_s = time.perf_counter() - start
        return BatchedRun(DriveResult(traces, wall_s, num_steps, decode_steps), outputs)

    def _set_token(self, row: int, sequence: _LiveSequence, *, logits: bool) -> None:
        batch = self._batch
        batch.token[row] = sequence.next_token
        batch.pos[row] = sequence.next_position
        batch.n_seq_id[row] = 1
        batch.seq_id[row][0] = sequence.seq_id
        batch.logits[row] = int(logits)

    def _argmax(self, row: int) -> int:
        pointer = self._llama_cpp.llama_get_logits_ith(self._context, row)
        return int(np.ctypeslib.as_array(pointer, shape=(self._vocab_size,)).argmax())

    def close(self) -> None:
        """Free the batch, the context and the model (safe to call twice)."""
        llama_cpp = self._llama_cpp
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._context:
            llama_cpp.llama_free(self._context)
            self._context = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> BatchedDecoder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def batched_wall_time(
    decoder: BatchedDecoder, prompts: Sequence[list[int]], output_lens: Sequence[int]
) -> Metrics:
    """The throughput benchmark's measurement: the wall time of the whole workload."""
    return {"wall_s": decoder.run(prompts, output_lens).result.wall_s}
