"""A user request as the engine keeps it: its n sequences and their outputs so far.

A request with ``n > 1`` runs as n scheduler sequences (ids ``req#0``,
``req#1``, ..., seeds ``seed + i``) that share one :class:`RequestGroup`;
:func:`make_group` builds it, :meth:`SequenceState.append_token` turns each
sampled token into text, logprobs and a finish reason, and
:meth:`RequestGroup.output` is the request's cumulative ``RequestOutput``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.structured import CompiledGrammar, GrammarState
from kvserve.worker.prompt_logprobs import PromptLogprobsChunk

if TYPE_CHECKING:
    from kvserve.loader.fast_tokenizer import AnyTokenizer

logger = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """One of a request's n completions, and what turns its tokens into text."""

    request: Request
    detokenizer: IncrementalDetokenizer
    completion: CompletionOutput

    def append_token(
        self,
        token_id: int,
        logprobs: dict[int, Logprob] | None,
        decode: Callable[[list[int]], str],
        scheduler: Scheduler,
        is_last: bool = True,
    ) -> bool:
        """Add a sampled token (already applied by ``scheduler``) to the completion.

        ``decode`` gives each logprob entry's text (the engine's ``token_decoder``). A
        stop string found in the new text finishes the sequence in ``scheduler``.
        is_last: the step's last token for this sequence; False for the tokens
        before it in a step that verified proposals, which did not end the
        request by themselves, whatever its status after the step.
        Returns whether a stop string ended the sequence at this token.
        """
        request, completion = self.request, self.completion
        completion.token_ids.append(token_id)
        if logprobs is not None and completion.logprobs is not None:
            decoded = {
                entry_id: dataclasses.replace(entry, decoded_token=decode([entry_id]))
                for entry_id, entry in logprobs.items()
            }
            completion.logprobs.append(decoded)
            previous = completion.cumulative_logprob or 0.0
            completion.cumulative_logprob = previous + decoded[token_id].logprob
        # A token that ended the request by itself (EOS, stop token) adds no text.
        stop = None
        ended_by_itself = is_last and request.status == RequestStatus.FINISHED_STOPPED
        if not ended_by_itself or request.grammar_completed:
            stop = self.detokenizer.append(token_id)
        if stop is None and is_last and request.is_finished:
            stop = self.detokenizer.flush()
        if stop is not None:
            scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            # A stop string wins over a length limit reached by the same token.
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop
        completion.text = self.detokenizer.output_text
        if request.is_finished:
            completion.finish_reason = request.status.finish_reason
            completion.stop_reason = request.stop_reason
        return stop is not None


@dataclass
class RequestGroup:
    """A user request: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    metrics: RequestMetrics
    error: str | None = None  # why the request failed, if it did
    embedding: list[float] | None = None  # an embedding request's vector, once pooled
    # With SamplingParams.prompt_logprobs: one entry per prompt token computed so far.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def seq_ids(self) -> list[str]:
        return [seq.request.request_id for seq in self.sequences]

    def output(self) -> RequestOutput:
        finished = all(seq.completion.finished() for seq in self.sequences)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[seq.completion for seq in self.sequences],
            finished=finished,
            metrics=self.metrics,
            error=self.error,
            embedding=self.embedding,
            prompt_logprobs=self.prompt_logprobs,
        )

    def add_prompt_logprobs(
        self, chunk: PromptLogprobsChunk, decode: Callable[[list[int]], str]
    ) -> None:
        """Append a step's prompt logprobs, each token's text decoded with ``decode``.

        A request preempted and recomputed sends positions it sent before: the
        values are the same, and only the positions not yet held are kept.
        """
        held = self.prompt_logprobs
        if held is None:
            return
        skip = len(held) - chunk.first_token_index
        if skip < 0:
            raise ValueError(
                f"prompt logprobs of request {self.request_id!r} arrived out of order: "
                f"token {chunk.first_token_index} after {len(held)} tokens"
            )
        for entry in chunk.entries[skip:]:
            held.append(
                {
                    token_id: dataclasses.replace(logprob, decoded_token=decode([token_id]))
                    for token_id, logprob in entry.items()
                }
            )

    def set_embedding(self, vector: list[float]) -> None:
        """An embedding request's pooled vector: the request is done (the scheduler
        finished it in the step that pooled it)."""
        self.embedding = vector
        for seq in self.sequences:
            seq.completion.finish_reason = "stop"

    def finish(self, scheduler: Scheduler, status: RequestStatus, reason: str) -> None:
        """Finish every sequence in ``scheduler`` (freeing its blocks); the unfinished
        ones get ``reason`` as their finish reason."""
        scheduler.finish_requests(self.seq_ids, status)
        for seq in self.sequences:
            if not seq.completion.finished():
                seq.completion.finish_reason = reason

    def fail(self, scheduler: Scheduler, stage: str, error: Exception) -> None:
        """Finish a request that failed by itself while ``stage``; the step goes on."""
        logger.error("request %s failed while %s", self.request_id, stage, exc_info=error)
        self.error = f"{stage} failed: {error!r}"
        self.finish(scheduler, RequestStatus.FINISHED_ERROR, "error")


def make_group(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    params: SamplingParams,
    metrics: RequestMetrics,
    tokenizer: AnyTokenizer,
    eos_token_ids: Sequence[int],
    compiled: futures.Future[CompiledGrammar] | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    pooling: PoolingParams | None = None,
) -> RequestGroup:
    """A checked request as a group of ``params.n`` sequences, none of them queued yet.

    compiled: the structured-outputs grammar (its compile may still be running);
        each sequence gets its own matcher on it.
    pooling: an embedding request's parameters (``params.n`` is then 1).
    """
    group = RequestGroup(request_id, prompt, prompt_token_ids, [], metrics)
    if params.prompt_logprobs is not None and pooling is None:
        group.prompt_logprobs = [None]  # the first prompt token has nothing before it
    for index in range(params.n):
        seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
        # Each of n sequences gets its own seed, so they differ yet reproduce.
        seed = None if params.seed is None else params.seed + index
        request = Request(
            seq_id,
            prompt_token_ids,
            params,
            eos_token_ids,
            seed,
            metrics.arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=pooling,
        )
        if index > 0:
            request.num_prompt_logprobs = None  # the first sequence computes them for all
        if compiled is not None:
            request.grammar = GrammarState(compiled)
        detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            params.stop_strings,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        completion = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        group.sequences.append(SequenceState(request, detokenizer, completion))
    return group
