"""LLMEngine: requests in, one batched step at a time, outputs out.

``add_request`` validates and queues; ``step`` schedules, runs the model once,
applies the sampled tokens, turns them into text and reports every request
that changed. A request with ``n > 1`` runs as n sequences that share its
request id in the outputs. After each step ``stats`` holds an
:class:`EngineStats` snapshot, and a tracer, if one is set
(:meth:`LLMEngine.set_trace`), records the step. With KV cache events on,
the prefix cache's changes of the step become one batch, published over ZMQ
and kept for :meth:`LLMEngine.take_kv_events`.

A failure that belongs to one request (sampling its token, detokenizing its
text) finishes that request alone, with ``RequestOutput.error`` saying why;
the rest of the step goes on. A failing forward pass raises from ``step``.

With ``tensor_parallel_size`` N > 1 the engine process is rank 0: it starts
(or joins, under torchrun) ranks 1..N-1, which each hold a share of the model
(``kvserve.distributed``); a rank that dies makes ``step`` raise
``TensorParallelError``. :meth:`LLMEngine.shutdown` stops them (so does the
engine's garbage collection, and the end of the process).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import KVEventBatch, KVEventCollector
from kvserve.core.request import Request, RequestStatus, check_priority_and_salt
from kvserve.core.scheduler import Scheduler
from kvserve.core.stats import EngineStats, collect_stats
from kvserve.distributed.group import SINGLE_RANK
from kvserve.distributed.launch import WorkerRanks, start_tensor_parallel
from kvserve.engine.detokenizer import IncrementalDetokenizer, decode_tokens
from kvserve.engine.kv_event_publisher import ZmqKVEventPublisher, import_kv_events_extra
from kvserve.errors import InvalidParameterError
from kvserve.loader import load_arch_config, load_tokenizer, resolve_model
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured import COMPILE_TIMEOUT_S, CompiledGrammar, GrammarCompiler, GrammarState
from kvserve.trace.tracer import StepTracer, TraceSink
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# A prompt is text, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | Sequence[int] | Mapping[str, Any]


@dataclass
class _Sequence:
    """One of a request's n completions, and what turns its tokens into text."""

    request: Request
    detokenizer: IncrementalDetokenizer
    completion: CompletionOutput


@dataclass
class _Group:
    """A user request: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    metrics: RequestMetrics
    error: str | None = None  # why the request failed, if it did

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
        )


class LLMEngine:
    """The synchronous engine: one forward pass per :meth:`step`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.kv_events_config.kv_events_endpoint is not None:
            import_kv_events_extra()  # a missing extra fails before the model loads
        self.source = source = resolve_model(
            config.model_config.model, config.model_config.revision
        )
        self.arch = arch = load_arch_config(source)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(source)
        self.max_model_len = self._resolve_max_model_len(arch.max_position_embeddings)
        self.vocab_size = arch.vocab_size
        eos = set(arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        # Ranks 1..N-1 (None with one rank), checked against the model before they start.
        self.worker_ranks: WorkerRanks | None = start_tensor_parallel(
            config, source, arch, self.max_model_len
        )
        if self.worker_ranks is None:
            self.runner = ModelRunner(config, source, arch, self.max_model_len, SINGLE_RANK)
        else:
            ranks = self.worker_ranks
            weakref.finalize(self, ranks.close)
            try:
                self.runner = ranks.run(
                    ModelRunner, config, source, arch, self.max_model_len, ranks.tp
                )
            except BaseException:
                ranks.close()
                raise
        sliding_windows = self.runner.sliding_windows
        has_sliding_window = any(window is not None for window in sliding_windows)
        events_config = config.kv_events_config
        self._kv_events: KVEventCollector | None = None
        self._kv_event_batches: deque[KVEventBatch] = deque(
            maxlen=events_config.kv_events_buffer_steps
        )
        self.kv_event_publisher: ZmqKVEventPublisher | None = None
        if events_config.collects_events:
            medium = "GPU" if self.runner.device.type == "cuda" else "CPU"
            self._kv_events = KVEventCollector(medium)
        if events_config.kv_events_endpoint is not None:
            self.kv_event_publisher = ZmqKVEventPublisher(
                events_config.kv_events_endpoint,
                events_config.kv_events_replay_endpoint,
                events_config.kv_events_topic,
                events_config.kv_events_buffer_steps,
                events_config.kv_events_hwm,
            )
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            config.cache_config.block_size,
            enable_caching=config.cache_config.prefix_caching_for(has_sliding_window),
            sliding_windows=sliding_windows,
            kv_events=self._kv_events,
        )
        self.scheduler = Scheduler(
            config.scheduler_config, self.kv_cache_manager, self.max_model_len
        )
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[str, tuple[_Group, _Sequence]] = {}
        # Structured outputs: sequences wait here, outside the scheduler, until
        # their grammar compiled; no step ever waits for a compile.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._compiling: list[Request] = []
        self.peak_num_blocks_used = 0
        self._num_steps = 0
        num_usable = self.kv_cache_manager.num_usable_blocks
        self.stats = EngineStats(num_blocks_total=num_usable, num_blocks_free=num_usable)
        self.tracer: StepTracer | None = None

    @classmethod
    def from_engine_args(cls, model: str, **engine_args: Any) -> LLMEngine:
        """``LLMEngine.from_engine_args("smollm2-135m-instruct", block_size=16, ...)``."""
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    def _resolve_max_model_len(self, model_len: int) -> int:
        requested = self.config.model_config.max_model_len
        if requested is None:
            return model_len
        if requested > model_len:
            raise InvalidParameterError(
                "max_model_len",
                f"must be at most the model's context length {model_len}, got {requested}",
            )
        return requested

    # ------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Prompt text (if given as text) and its token ids, checked against the vocabulary."""
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(str(prompt["prompt"]))
            raise InvalidParameterError(
                "prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'"
            )
        else:
            text, token_ids = None, self._check_token_ids(prompt)
        if not token_ids:
            raise InvalidParameterError("prompt", "must not be empty")
        return text, token_ids

    def _check_token_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
            raise InvalidParameterError("prompt_token_ids", "must be a list of token ids")
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidParameterError(
                    "prompt_token_ids", f"must hold integers, got {token_id!r}"
                )
            if not 0 <= token_id < self.vocab_size:
                raise InvalidParameterError(
                    "prompt_token_ids", f"token id {token_id} is outside [0, {self.vocab_size})"
                )
        if not token_ids:
            raise InvalidParameterError("prompt", "must not be empty")
        return list(token_ids)

    def check_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Raise if a request with this prompt and these parameters could never run."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params", "must be a SamplingParams")
        check_priority_and_salt(priority, cache_salt, self.config.scheduler_config.policy)
        params.check_vocab(self.vocab_size)
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise InvalidParameterError(
                "prompt",
                f"has {num_prompt} tokens; max_model_len is {self.max_model_len}, which must also "
                "leave room for at least one generated token",
            )
        total = num_prompt + params.max_tokens
        if total > self.max_model_len:
            raise InvalidParameterError(
                "max_tokens",
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len}",
            )
        scheduler_config = self.config.scheduler_config
        manager = self.kv_cache_manager
        max_chunk = scheduler_config.max_num_batched_tokens
        if not manager.can_ever_fit(total, max_chunk):
            raise InvalidParameterError(
                "max_tokens",
                f"prompt + max_tokens = {total} tokens need {manager.num_blocks_for(total, max_chunk)} "
                f"KV blocks of {manager.block_size} tokens; the KV cache has "
                f"{manager.num_usable_blocks}",
            )
        if (
            not scheduler_config.enable_chunked_prefill
            and total > scheduler_config.max_num_batched_tokens
        ):
            raise InvalidParameterError(
                "prompt",
                f"prompt + max_tokens = {total} tokens exceeds max_num_batched_tokens "
                f"{scheduler_config.max_num_batched_tokens}; enable chunked prefill for long prompts",
            )

    def compile_grammar(self, params: SamplingParams) -> futures.Future[CompiledGrammar] | None:
        """Start (or find in the cache) the compile of ``params``' structured-outputs spec.

        None when the request is unconstrained. The future raises
        InvalidParameterError for a spec that does not compile; callers that must
        refuse such a request before queuing it wait on it first. Thread-safe.
        """
        if params.structured_outputs is None:
            return None
        return self.grammar_compiler.compile(params.structured_outputs.spec)

    def check_grammar(self, params: SamplingParams) -> None:
        """Wait for ``params``' grammar to compile; InvalidParameterError if it does not.

        For callers off the event loop (the offline :class:`~kvserve.LLM`); the
        compile runs on the compiler's threads and is cached for the request.
        """
        compiled = self.compile_grammar(params)
        if compiled is None:
            return
        try:
            compiled.result(timeout=COMPILE_TIMEOUT_S)
        except futures.TimeoutError:
            raise InvalidParameterError(
                "structured_outputs", f"took longer than {COMPILE_TIMEOUT_S} s to compile"
            ) from None

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request. Nothing changes if it raises.

        cache_salt: only requests with the same salt share prefix-cache
            blocks (tenants who must not share cache get different salts).
        priority: lower runs first; needs ``policy="priority"``.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, prompt_token_ids = self.tokenize_prompt(prompt)
        self.check_request(prompt_token_ids, params, priority, cache_salt)
        if request_id in self._groups:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(request_id, text, prompt_token_ids, [], RequestMetrics(arrival_time))
        compiled = self.compile_grammar(params)
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            # Each of n sequences gets its own seed, so they differ yet reproduce.
            seed = None if params.seed is None else params.seed + index
            request = Request(
                seq_id,
                prompt_token_ids,
                params,
                self.eos_token_ids,
                seed,
                arrival_time,
                priority=priority,
                cache_salt=cache_salt,
            )
            if compiled is not None:
                request.grammar = GrammarState(compiled)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop_strings,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            completion = CompletionOutput(
                index, logprobs=[] if params.logprobs is not None else None
            )
            group.sequences.append(_Sequence(request, detokenizer, completion))
        self._groups[request_id] = group
        for seq in group.sequences:
            self._sequences[seq.request.request_id] = (group, seq)
            if compiled is None:
                self.scheduler.add_request(seq.request)
            else:
                self._compiling.append(seq.request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            seq_ids = [seq.request.request_id for seq in group.sequences]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            self._drop_compiling(group)
            for seq in group.sequences:
                if not seq.completion.finished():
                    seq.completion.finish_reason = "abort"
                del self._sequences[seq.request.request_id]

    def abort_running_requests(self) -> list[str]:
        """Abort every request with a sequence in the running set; return their ids.

        After a step raised, the requests it was computing are in an unknown
        state; this drops them (and frees their blocks) so that the waiting
        ones can still be served.
        """
        request_ids = {
            self._sequences[request.request_id][0].request_id
            for request in self.scheduler.running
            if request.request_id in self._sequences
        }
        self.abort_request(request_ids)
        return sorted(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def kv_bytes_held(self, seq_id: str) -> int:
        """KV cache bytes sequence ``seq_id`` holds now, over all KV cache groups.

        ``seq_id`` is the request id, or ``f"{request_id}#{index}"`` for one of
        ``n > 1`` sequences; 0 for one that holds nothing.
        """
        return self.kv_cache_manager.num_held_blocks(seq_id) * self.runner.kv_bytes_per_block

    def set_trace(self, sink: TraceSink | None) -> None:
        """Record every later step into ``sink`` as a new run of its trace; None stops recording."""
        self.tracer = None if sink is None else StepTracer(sink, self)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests hold blocks."""
        done = self.kv_cache_manager.reset_prefix_cache()
        self._flush_kv_events()
        return done

    # ----------------------------------------------------- KV cache events

    def take_kv_events(self) -> list[KVEventBatch]:
        """The KV event batches (one per step that changed the prefix cache) not yet taken.

        Oldest first; at most ``kv_events_buffer_steps`` are kept. Empty when
        events are off. Safe to call from another thread than the one stepping.
        """
        batches = []
        while True:
            try:
                batches.append(self._kv_event_batches.popleft())
            except IndexError:
                return batches

    def _flush_kv_events(self) -> None:
        """Turn the events recorded since the last flush into a batch and hand it out."""
        if self._kv_events is None or not len(self._kv_events):
            return
        batch = KVEventBatch(time.time(), tuple(self._kv_events.take()))
        self._kv_event_batches.append(batch)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(batch)

    def shutdown(self) -> None:
        """Release what the engine holds outside its memory: the KV event sockets and
        the tensor-parallel ranks. The engine cannot step afterwards."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        if self.worker_ranks is not None:
            self.worker_ranks.close()

    # ---------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the requests that advanced (cumulative outputs).

        Requests that failed by themselves come back finished, with ``error`` set.
        """
        started = time.perf_counter()
        compile_failed = self._admit_compiled()
        scheduler_output = self.scheduler.schedule()
        num_used = self.kv_cache_manager.num_usable_blocks - self.kv_cache_manager.num_free_blocks
        self.peak_num_blocks_used = max(self.peak_num_blocks_used, num_used)
        if scheduler_output.is_empty:
            self.stats = collect_stats(self.scheduler, scheduler_output, self._num_steps)
            self._flush_kv_events()
            if self.tracer is not None and scheduler_output.num_preempted:
                # Nothing ran, but requests lost their blocks: the trace must say so.
                self.tracer.record_step(scheduler_output, started, num_used)
            if self._compiling and not compile_failed:
                # Nothing to run until a grammar is ready: wait for one, briefly, not spin.
                pending = [r.grammar.compiled for r in self._compiling if r.grammar is not None]
                futures.wait(pending, timeout=0.05, return_when=futures.FIRST_COMPLETED)
            return [self._finished_output(group) for group in compile_failed]
        now = time.monotonic()
        for item in scheduler_output.scheduled:
            metrics = self._sequences[item.request.request_id][0].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        if self.worker_ranks is None:
            runner_output = self.runner.execute(scheduler_output)
        else:
            runner_output = self.worker_ranks.run(self.runner.execute, scheduler_output)
        self._advance_grammars(runner_output.sampled_token_ids, runner_output.failed)
        self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        changed: dict[str, _Group] = {group.request_id: group for group in compile_failed}
        for seq_id, error in runner_output.failed.items():
            group = self._sequences[seq_id][0]
            self._fail(group, "sampling its next token", error)
            changed[group.request_id] = group
        for seq_id, token_id in runner_output.sampled_token_ids.items():
            group, seq = self._sequences[seq_id]
            changed[group.request_id] = group
            if group.error is not None:
                continue  # another of its sequences failed in this step
            try:
                self._append_token(seq, token_id, runner_output.logprobs.get(seq_id))
            except Exception as exc:
                self._fail(group, "turning its tokens into text", exc)
        outputs = []
        now = time.monotonic()
        for group in changed.values():
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
            output = group.output()
            if output.finished:
                del self._groups[group.request_id]
                for seq in group.sequences:
                    del self._sequences[seq.request.request_id]
            outputs.append(output)
        self._num_steps += 1
        self.stats = collect_stats(self.scheduler, scheduler_output, self._num_steps)
        self._flush_kv_events()
        if self.tracer is not None:
            self.tracer.record_step(scheduler_output, started, num_used)
        return outputs

    def _admit_compiled(self) -> list[_Group]:
        """Queue the sequences whose grammar compiled; fail those whose compile raised."""
        failed: dict[str, _Group] = {}
        still: list[Request] = []
        for request in self._compiling:
            grammar = request.grammar
            assert grammar is not None
            if not grammar.ready:
                still.append(request)
                continue
            group = self._sequences[request.request_id][0]
            if group.error is not None:
                continue  # a sibling's compile failed; the group is finished already
            try:
                grammar.start()
            except Exception as exc:
                self._fail(group, "compiling its structured-outputs grammar", exc)
                failed[group.request_id] = group
                continue
            self.scheduler.add_request(request)
        self._compiling = [r for r in still if self._sequences[r.request_id][0].error is None]
        return list(failed.values())

    def _drop_compiling(self, group: _Group) -> None:
        """Forget the group's sequences still waiting for their grammar (an abort)."""
        for seq in group.sequences:
            seq.request.grammar = None
        ids = {seq.request.request_id for seq in group.sequences}
        self._compiling = [r for r in self._compiling if r.request_id not in ids]

    def _finished_output(self, group: _Group) -> RequestOutput:
        """The last output of a group that finished outside a step; forgets the group."""
        del self._groups[group.request_id]
        for seq in group.sequences:
            del self._sequences[seq.request.request_id]
        return group.output()

    def _advance_grammars(self, sampled: dict[str, int], failed: dict[str, Exception]) -> None:
        """Feed each constrained sequence its sampled token; a refused token fails the sequence."""
        for seq_id, token_id in list(sampled.items()):
            grammar = self._sequences[seq_id][1].request.grammar
            if grammar is None:
                continue
            try:
                grammar.accept(token_id)
            except ValueError as exc:
                failed[seq_id] = exc
                del sampled[seq_id]

    def _fail(self, group: _Group, stage: str, error: Exception) -> None:
        """Finish a request that failed by itself and free its blocks; the step goes on."""
        logger.error("request %s failed while %s", group.request_id, stage, exc_info=error)
        group.error = f"{stage} failed: {error!r}"
        seq_ids = [seq.request.request_id for seq in group.sequences]
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ERROR)
        for seq in group.sequences:
            if not seq.completion.finished():
                seq.completion.finish_reason = "error"

    def _append_token(
        self, seq: _Sequence, token_id: int, logprobs: dict[int, Logprob] | None
    ) -> None:
        request, completion = seq.request, seq.completion
        completion.token_ids.append(token_id)
        if logprobs is not None and completion.logprobs is not None:
            decoded = {
                entry_id: dataclasses.replace(
                    entry, decoded_token=decode_tokens(self.tokenizer, [entry_id])
                )
                for entry_id, entry in logprobs.items()
            }
            completion.logprobs.append(decoded)
            previous = completion.cumulative_logprob or 0.0
            completion.cumulative_logprob = previous + decoded[token_id].logprob
        # A token that ended the request by itself (EOS, stop token) adds no text.
        stop = None
        if request.status != RequestStatus.FINISHED_STOPPED or request.grammar_completed:
            stop = seq.detokenizer.append(token_id)
        if stop is None and request.is_finished:
            stop = seq.detokenizer.flush()
        if stop is not None:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            # A stop string wins over a length limit reached by the same token.
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop
        completion.text = seq.detokenizer.output_text
        if request.is_finished:
            completion.finish_reason = request.status.finish_reason
            completion.stop_reason = request.stop_reason
