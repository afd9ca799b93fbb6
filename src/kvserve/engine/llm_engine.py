"""LLMEngine: requests in, one batched step at a time, outputs out.

``add_request`` validates and queues; ``step`` schedules, runs the model once,
applies the sampled tokens, turns them into text and reports every request
that changed. A request with ``n > 1`` runs as n sequences that share its
request id in the outputs. After each step ``stats`` holds its
:class:`~kvserve.core.step_report.StepReport`, the one record of the step that
metrics, trace, dashboard and benchmarks format; a recorder attached with
:meth:`LLMEngine.set_trace` gets every report too. With KV cache events on,
the prefix cache's changes of the step become one batch, published over ZMQ
and kept for :meth:`LLMEngine.take_kv_events`. With a draft model for
speculative decoding, the draft runs in an engine of its own that this one
holds (``draft_proposer.py``).

A failure that belongs to one request (sampling its token, detokenizing its
text) finishes that request alone, with ``RequestOutput.error`` saying why;
the rest of the step goes on. A failing forward pass raises from ``step``.

With ``tensor_parallel_size`` N > 1 the engine process is rank 0: it starts
(or joins, under torchrun) ranks 1..N-1, which each hold a share of the model
(``kvserve.executor``); a rank that dies makes ``step`` raise
``TensorParallelError``. :meth:`LLMEngine.shutdown` stops them (so does the
engine's garbage collection, and the end of the process).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineConfig
from kvserve.core.disk_store import DiskBlockStore
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import KVEventBatch
from kvserve.core.request import Request, RequestStatus, check_priority_and_salt
from kvserve.core.scheduler import Scheduler
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.core.stats import collect_stats, view_pool
from kvserve.core.step_report import PoolView, RunInfo, StepObserver, StepRecorder, StepReport
from kvserve.distributed.group import SINGLE_RANK
from kvserve.engine.detokenizer import token_decoder
from kvserve.engine.disk_tier import DiskTier, open_disk_store
from kvserve.engine.draft_proposer import DraftModelProposer, draft_config
from kvserve.engine.engine_client import EngineLimits, PromptType
from kvserve.engine.grammar_waitlist import GrammarWaitlist, advance_grammars
from kvserve.engine.kv_event_publisher import ZmqKVEventPublisher, import_kv_events_extra
from kvserve.engine.kv_events_hub import KVEventsHub
from kvserve.engine.request_checks import RequestValidator, resolve_max_model_len
from kvserve.engine.request_group import RequestGroup, SequenceState, make_group
from kvserve.errors import InvalidParameterError
from kvserve.executor.launch import WorkerRanks, start_tensor_parallel
from kvserve.kernels.heap import release_free_heap
from kvserve.loader import load_arch_config, load_tokenizer, resolve_model
from kvserve.outputs import Logprob, RequestMetrics, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.structured import GrammarCompiler
from kvserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from kvserve.loader.fast_tokenizer import AnyTokenizer

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    """The synchronous engine: one forward pass per :meth:`step`.

    Its request checks (``tokenize_prompt``, ``check_request``, ``compile_grammar``,
    ``check_grammar``) are :attr:`validator`'s, a
    :class:`~kvserve.engine.request_checks.RequestValidator` on :attr:`limits`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.kv_events_config.kv_events_endpoint is not None:
            import_kv_events_extra()  # a missing extra fails before the model loads
        self.source = source = resolve_model(
            config.model_config.model, config.model_config.revision
        )
        self.arch = arch = load_arch_config(source)
        self.tokenizer: AnyTokenizer = load_tokenizer(source)
        self.max_model_len = resolve_max_model_len(config, arch.max_position_embeddings)
        self.vocab_size = arch.vocab_size
        eos = set(arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        # Each logprob entry's text, generated or prompt (the fast tokenizer's own decode).
        self._decode_token = token_decoder(self.tokenizer)
        # A draft model is checked (vocabulary) and loaded before the target's weights.
        self.draft_proposer: DraftModelProposer | None = None
        speculative = config.speculative_config
        if speculative is not None and speculative.method == "draft_model":
            draft = LLMEngine(draft_config(config, self.tokenizer, self.max_model_len))
            self.draft_proposer = DraftModelProposer(draft, self.vocab_size)
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
        medium = "GPU" if self.runner.device.type == "cuda" else "CPU"
        self.kv_events = KVEventsHub(config.kv_events_config, medium)
        self.kv_event_publisher: ZmqKVEventPublisher | None = self.kv_events.publisher
        enable_caching = config.cache_config.prefix_caching_for(has_sliding_window)
        disk_store = self._open_disk_store() if enable_caching else None
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            config.cache_config.block_size,
            enable_caching=enable_caching,
            sliding_windows=sliding_windows,
            kv_events=self.kv_events.collector,
            disk_store=disk_store,
            disk_write_generated=config.cache_config.prefix_cache_disk_write == "all",
        )
        # The prefix cache's second tier (prefix_cache_dir): requests waiting for blocks
        # read from disk wait here, outside the scheduler, as grammars do.
        self.disk_tier: DiskTier | None = None
        if disk_store is not None:
            self.disk_tier = DiskTier(
                disk_store,
                self.kv_cache_manager,
                self.runner.kv_cache,
                config.cache_config.prefix_cache_disk_min_blocks,
            )
            weakref.finalize(self, self.disk_tier.close)
        self.scheduler = Scheduler(
            config.scheduler_config,
            self.kv_cache_manager,
            self.max_model_len,
            config.speculative_config,
            self.draft_proposer,
        )
        self._groups: dict[str, RequestGroup] = {}
        self._sequences: dict[str, tuple[RequestGroup, SequenceState]] = {}
        # Structured outputs: sequences wait here, outside the scheduler, until
        # their grammar compiled; no step ever waits for a compile.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        manager = self.kv_cache_manager
        task = self.runner.task
        kv_cache_tokens = manager.num_usable_blocks * manager.block_size
        # An embedding prompt runs whole in one step: within the model's limit, the
        # context, the step's token budget and the KV cache.
        embed_limits = [self.max_model_len, kv_cache_tokens]
        embed_limits.append(config.scheduler_config.max_num_batched_tokens)
        if task.max_embed_tokens is not None:
            embed_limits.append(task.max_embed_tokens)
        self.limits = EngineLimits(
            self.max_model_len,
            self.vocab_size,
            kv_cache_tokens,
            generates=task.generates,
            pooling=task.pooling,
            max_embed_tokens=min(embed_limits) if task.pooling is not None else 0,
        )
        self.validator = RequestValidator(
            self.limits,
            self.tokenizer,
            config.scheduler_config,
            self.kv_cache_manager,
            self.grammar_compiler,
        )
        self._compiling = GrammarWaitlist()
        self.peak_num_blocks_used = 0
        self._num_steps = 0
        num_usable = self.kv_cache_manager.num_usable_blocks
        self.stats = StepReport(num_blocks_total=num_usable, num_blocks_free=num_usable)
        scheduler_config = config.scheduler_config
        spec_config = config.speculative_config
        self.run_info = RunInfo(
            model=config.model_config.model,
            block_size=self.kv_cache_manager.block_size,
            num_blocks=num_usable,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_num_seqs=scheduler_config.max_num_seqs,
            enable_chunked_prefill=scheduler_config.enable_chunked_prefill,
            max_prefill_tokens_while_decoding=scheduler_config.max_prefill_tokens_while_decoding,
            policy=scheduler_config.policy,
            enable_prefix_caching=self.kv_cache_manager.enable_caching,
            spec_method=None if spec_config is None else spec_config.method,
            spec_adaptive=spec_config is not None and spec_config.adaptive,
        )
        self.tracer: StepObserver | None = None
        # Loading's freed temporaries would otherwise stay resident as long as we run.
        release_free_heap()

    def _open_disk_store(self) -> DiskBlockStore | None:
        """The disk tier's store, in a folder named by what the pool's bytes mean."""
        runner = self.runner
        shape = tuple(runner.kv_cache.shape)
        identity_fields = {
            "device": runner.device.type,
            "kv_cache_dtype": str(runner.kv_cache_dtype),
            "precision": runner.describe_precision(),
            "attention": type(runner.attention_backend).__name__,
            "block_size": self.config.cache_config.block_size,
            # [G, 2, block_size, Hkv, D]: one block of the pool, num_blocks left out.
            "block_shape": [*shape[:2], *shape[3:]],
        }
        return open_disk_store(self.config, self.source, identity_fields, runner.kv_bytes_per_block)

    @classmethod
    def from_engine_args(cls, model: str, **engine_args: Any) -> LLMEngine:
        """``LLMEngine.from_engine_args("smollm2-135m-instruct", block_size=16, ...)``."""
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Validate and queue a request. Nothing changes if it raises.

        cache_salt: only requests with the same salt share prefix-cache
            blocks (tenants who must not share cache get different salts).
        priority: lower runs first; needs ``policy="priority"``.
        pooling_params: makes it an embedding request: its output's ``embedding``
            is the pooled vector, and ``sampling_params`` must be None.
        """
        if pooling_params is not None:
            if sampling_params is not None:
                raise InvalidParameterError(
                    "sampling_params", "must be None for an embedding request"
                )
            prepared = self.validator.prepare_embedding(request_id, prompt, pooling_params)
            text, prompt_token_ids = prepared.prompt, prepared.prompt_token_ids
            params = prepared.params
            check_priority_and_salt(priority, cache_salt, self.config.scheduler_config.policy)
        else:
            params = sampling_params if sampling_params is not None else SamplingParams()
            text, prompt_token_ids = self.validator.tokenize_prompt(prompt)
            self.validator.check_request(prompt_token_ids, params, priority, cache_salt)
        if request_id in self._groups:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        compiled = self.validator.compile_grammar(params)
        group = make_group(
            request_id,
            text,
            prompt_token_ids,
            params,
            RequestMetrics(arrival_time),
            self.tokenizer,
            self.eos_token_ids,
            compiled,
            priority,
            cache_salt,
            pooling_params,
        )
        self._groups[request_id] = group
        for seq in group.sequences:
            self._sequences[seq.request.request_id] = (group, seq)
            if compiled is None:
                self._queue(seq.request)
            else:
                self._compiling.add(seq.request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            group.finish(self.scheduler, RequestStatus.FINISHED_ABORTED, "abort")
            self._compiling.drop(group)
            if self.disk_tier is not None:
                self.disk_tier.drop(set(group.seq_ids))
            self._forget(group)

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

    def set_trace(self, sink: StepRecorder | None) -> None:
        """Record every later step into ``sink`` (a ``kvserve.trace`` sink) as a new run of it;
        None stops recording."""
        self.tracer = None if sink is None else sink.start_run(self.run_info, self.stats)

    def view_pool(self, max_waiting: int) -> PoolView:
        """The sequences and their blocks now (running ones, then ``max_waiting`` waiting ones).

        Costs a copy of every running sequence's block table: for occasional
        pictures such as the dashboard's frames, not for every step.
        """
        return view_pool(self.scheduler, max_waiting)

    def reset_prefix_cache(self, disk: bool = False) -> bool:
        """Empty the prefix cache; refused (False) while requests hold blocks.

        disk: empty the disk tier too (its blocks of this model and setting),
        for a start as cold as a first run; by default it stays, as it would
        across a restart.
        """
        done = self.kv_cache_manager.reset_prefix_cache()
        if done and disk and self.disk_tier is not None:
            self.disk_tier.clear()
        self.kv_events.flush()
        return done

    def forget_speculation_outputs(self) -> None:
        """Make the speculative proposer forget finished requests' outputs (suffix
        decoding's store, a draft model's prefix cache); running requests keep their own
        state. Nothing to do without speculation."""
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.forget_outputs()

    # ----------------------------------------------------- KV cache events

    def take_kv_events(self) -> list[KVEventBatch]:
        """The KV event batches not yet taken, oldest first (see :meth:`KVEventsHub.take`)."""
        return self.kv_events.take()

    def shutdown(self) -> None:
        """Release what the engine holds outside its memory: the KV event sockets and
        the tensor-parallel ranks. The engine cannot step afterwards."""
        self.kv_events.shutdown()
        if self.disk_tier is not None:
            self.disk_tier.close()
        if self.worker_ranks is not None:
            self.worker_ranks.close()
        if self.draft_proposer is not None:
            self.draft_proposer.shutdown()

    # ---------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the requests that advanced (cumulative outputs).

        Requests that failed by themselves come back finished, with ``error`` set.
        """
        started = time.perf_counter()
        compile_failed = self._compiling.admit(self._sequences, self.scheduler, self._queue)
        if self.disk_tier is not None:
            self.disk_tier.admit(self.scheduler.add_request)
        scheduler_output = self.scheduler.schedule()
        num_used = self.kv_cache_manager.num_usable_blocks - self.kv_cache_manager.num_free_blocks
        self.peak_num_blocks_used = max(self.peak_num_blocks_used, num_used)
        if scheduler_output.is_empty:
            self._report(scheduler_output, started, num_used)
            if self.tracer is not None and scheduler_output.num_preempted:
                # Nothing ran, but requests lost their blocks: the trace must say so.
                self.tracer.record_step(self.stats)
            if self._compiling and not compile_failed:
                # Nothing to run until a grammar is ready: wait for one, briefly, not spin.
                self._compiling.wait_for_one(timeout=0.05)
            elif self.disk_tier:
                self.disk_tier.wait_for_one(timeout=0.05)  # the same for blocks read from disk
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
        advance_grammars(self._sequences, runner_output.sampled_token_ids, runner_output.failed)
        self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids, runner_output.verified_token_ids
        )
        if self.disk_tier is not None:
            self.disk_tier.write_behind()  # before the next schedule reuses any block
        changed: dict[str, RequestGroup] = {group.request_id: group for group in compile_failed}
        for seq_id, error in runner_output.failed.items():
            group = self._sequences[seq_id][0]
            group.fail(self.scheduler, "sampling its next token", error)
            changed[group.request_id] = group
        for seq_id, chunk in runner_output.prompt_logprobs.items():
            group = self._sequences[seq_id][0]
            try:
                group.add_prompt_logprobs(chunk, self._decode_token)
            except Exception as exc:
                group.fail(self.scheduler, "turning its prompt logprobs into text", exc)
                changed[group.request_id] = group
        for seq_id, vector in runner_output.embeddings.items():
            group = self._sequences[seq_id][0]
            group.set_embedding(vector)
            changed[group.request_id] = group
        for seq_id, token_id in runner_output.sampled_token_ids.items():
            group, seq = self._sequences[seq_id]
            changed[group.request_id] = group
            if group.error is not None:
                continue  # another of its sequences failed in this step
            try:
                logprobs = runner_output.logprobs.get(seq_id)
                seq.append_token(token_id, logprobs, self._decode_token, self.scheduler)
            except Exception as exc:
                group.fail(self.scheduler, "turning its tokens into text", exc)
        for seq_id, token_ids in runner_output.verified_token_ids.items():
            group, seq = self._sequences[seq_id]
            changed[group.request_id] = group
            if group.error is None:
                logprobs_list = runner_output.verified_logprobs.get(seq_id)
                self._append_verified(group, seq, token_ids, logprobs_list)
        outputs = []
        now = time.monotonic()
        for group in changed.values():
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
            output = group.output()
            if output.finished:
                self._forget(group)
            outputs.append(output)
        self._num_steps += 1
        self._report(scheduler_output, started, num_used)
        if self.tracer is not None:
            self.tracer.record_step(self.stats)
        return outputs

    def _append_verified(
        self,
        group: RequestGroup,
        seq: SequenceState,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]] | None,
    ) -> None:
        """Turn a step's several tokens of one sequence into text, one token at a time.

        The scheduler applied them already (``token_ids`` ends at a token-level
        stop); a stop string found before the last one ends the sequence there,
        and the tokens after it are forgotten, as if never generated.
        """
        request = seq.request
        last = len(token_ids) - 1
        try:
            for index, token_id in enumerate(token_ids):
                entry = logprobs[index] if logprobs else None
                stopped = seq.append_token(
                    token_id, entry, self._decode_token, self.scheduler, index == last
                )
                if stopped and index < last:
                    request.drop_output_tokens_after(request.num_output_tokens - (last - index))
                    break
        except Exception as exc:
            group.fail(self.scheduler, "turning its tokens into text", exc)

    def _report(self, output: SchedulerOutput, started: float, num_blocks_used: int) -> None:
        """End a step: publish its KV events and make its report the engine's ``stats``."""
        self.kv_events.flush()
        self.scheduler.observe_step_time(output, time.perf_counter() - started)
        self.stats = collect_stats(
            self.scheduler,
            output,
            self._num_steps,
            started=started,
            ended=time.perf_counter(),
            num_blocks_used_in_step=num_blocks_used,
            per_sequence=self.tracer is not None,
        )

    def _queue(self, request: Request) -> None:
        """Hand a request to the scheduler, unless it first waits for blocks from disk."""
        if self.disk_tier is None or not self.disk_tier.holds_back(request):
            self.scheduler.add_request(request)

    def _finished_output(self, group: RequestGroup) -> RequestOutput:
        """The last output of a group that finished outside a step; forgets the group."""
        self._forget(group)
        return group.output()

    def _forget(self, group: RequestGroup) -> None:
        """Drop a finished (or aborted) group and its sequences from the engine's tables."""
        del self._groups[group.request_id]
        for seq_id in group.seq_ids:
            del self._sequences[seq_id]
