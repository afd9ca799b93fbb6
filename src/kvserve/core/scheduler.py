"""Continuous batching: which requests run in the next forward pass, and how far.

Each step has a token budget (``max_num_batched_tokens``) and a request cap
(``max_num_seqs``). The scheduler fills it in three passes:

1. running requests that need a single token (decodes) — they are cheap and
   a user is waiting on each of them;
2. running requests still working through their prompt (chunked prefill);
3. waiting requests, in the policy's order (arrival, or priority then
   arrival; see ``request_queue.py``), as long as budget, seats and blocks
   last. With prefix caching a request first takes the longest cached prefix
   of its tokens, in whole blocks, and only the rest is scheduled. A request
   that asks for prompt logprobs takes no hit: its prompt's logits are needed
   at every position, and a cached block holds K/V, not logits.

A step that decodes also caps its prefill chunks at
``max_prefill_tokens_while_decoding``: every decoding stream waits for the
whole step, so a long chunk beside them is a long pause between their tokens.
A step with nothing to decode takes prompts up to the full budget.

Every scheduled request gets ``num_new_tokens``: how many of its not yet
computed tokens this step covers. A chunk that reaches the end of the
request's known tokens makes it sample one new token.

With sliding-window layers (see ``kv_cache_groups.py``) every KV cache group
has its own block table; an allocation succeeds for all groups or for none,
and after each step the blocks that left every window go back to the pool.

When the pool runs out of blocks for a running request, the policy's victim
(``fcfs``: the newest running request; ``priority``: the lowest priority,
then the newest) is preempted: its blocks are freed (cached ones stay in the
prefix cache, so it often finds them again), its generated tokens kept, and
it goes back to the waiting queue, at its original place in arrival order,
to be recomputed later. It is readmitted only once the free blocks cover
its worst case and that of every running request preempted after it (see
``readmission.py``), so it is never preempted again, and a pool that holds
one request's worst case finishes every request. Under the ``priority``
policy a waiting request may also preempt running requests of strictly
lower priority to get a seat or blocks.

Embedding requests (``Request.is_pooling``) are prompts computed once and
pooled, never sampled: they share the token budget and the step with the
other requests, but each is scheduled whole (a pooled vector needs every
token's hidden state in one forward pass, and an encoder attends over the
whole sequence at once), takes no prefix-cache hit and fills no cache entry,
and finishes in the step that computes it, so its KV blocks return to the
pool at once. A prompt longer than the cap on prefill beside decodes may
still run as the step's first prefill, so that decodes cannot starve it.

A waiting request whose next uncached block another request computes in
this very step (the n sequences of one prompt, a burst of requests sharing a
system prompt) waits one step and then takes that block from the cache
instead of computing it again.

With ``speculative_config`` set, a running request about to decode gets up
to ``num_speculative_tokens`` proposals (``ngram_proposer.py``,
``suffix_proposer.py`` or the engine's draft model, each told of every
finished request; see ``proposer.py``), scheduled as
more query tokens of its step under the token budget (they do not count
against the cap on prefill beside decodes); their KV slots are allocated with
the rest, and when the pool is short the proposals are dropped before anyone
is preempted. After the step the request keeps the proposals the sampler
accepted plus one token; ``num_computed_tokens`` is set back past the
rejected ones and the blocks that held only rejected tokens go back to the
pool. Only whole blocks of computed, kept tokens are ever cached, so no
rejected token reaches the prefix cache. Requests with a grammar get no
proposals (the mask of each proposal's position would need the grammar
advanced through the proposals before them).

Pure Python: no tensors here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.core.kv_cache_manager import NO_HIT, ComputedBlocks, KVCacheManager
from kvserve.core.ngram_proposer import NgramProposer
from kvserve.core.proposer import Proposer
from kvserve.core.readmission import fits_to_the_end
from kvserve.core.request import Request, RequestStatus, next_arrival_order
from kvserve.core.request_queue import RequestQueue, make_request_queue, preemption_key
from kvserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.core.spec_policy import SpeculationPolicy
from kvserve.core.suffix_proposer import SuffixProposer

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]


@dataclass
class _StepBudget:
    """Tokens left in this step, and of those how many prefill chunks may still take;
    mutated as requests are scheduled or preempted."""

    tokens: int
    prefill_tokens: int
    # Decodes not yet scheduled: proposals leave each of them its token.
    decodes_left: int = 0

    def __post_init__(self) -> None:
        self.prefill_cap = self.prefill_tokens  # what the step started with

    def for_prefill(self) -> int:
        return min(self.tokens, self.prefill_tokens)


class Scheduler:
    """Decides each step's batch and applies its results.

    speculative_config: proposals for decoding requests (None: none). The
    counters ``num_spec_proposed_total`` and ``num_spec_accepted_total``
    count proposed and accepted tokens since the start.
    proposer: where the proposals come from; None builds the one the config
        names (:func:`make_proposer`). The draft model's proposer runs a
        model, so the engine builds it and passes it here.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting: RequestQueue = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.speculative_config = speculative_config
        if proposer is not None and speculative_config is None:
            raise ValueError("a proposer needs a speculative_config")
        self.proposer = proposer if proposer is not None else make_proposer(speculative_config)
        adaptive = speculative_config is not None and speculative_config.adaptive
        self.spec_policy = SpeculationPolicy() if adaptive else None
        self.num_spec_proposed_total = 0
        self.num_spec_accepted_total = 0

    # ----------------------------------------------------------------- queue

    def add_request(self, request: Request) -> None:
        """Queue a request; the engine has validated it already."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        # Arrival is when the request reaches the queue (a constrained one may have
        # waited for its grammar first): queue order and preemption order then agree.
        request.arrival_order = next_arrival_order()
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string) and free their blocks at once.

        Unknown or already finished ids are ignored, so a late abort is harmless.
        """
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick the requests and token counts of the next forward pass."""
        output = SchedulerOutput()
        running = self.running
        if self.config.policy == "priority":
            running = sorted(running, key=self._preemption_key)  # most important first
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        total = self.config.max_num_batched_tokens
        cap = self.config.max_prefill_tokens_while_decoding
        chunked = self.config.enable_chunked_prefill
        budget = _StepBudget(
            total, cap if decodes and cap is not None and chunked else total, len(decodes)
        )
        if self.spec_policy is not None:
            admits = bool(self.waiting) and len(running) < self.config.max_num_seqs
            self.spec_policy.begin_step(len(decodes), computes_prompts=bool(prefills) or admits)
        for request in decodes + prefills:
            if budget.tokens == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for another request
            self._schedule_running(request, budget, output)
        if output.num_preempted == 0:
            self._schedule_waiting(budget, output)
        return output

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """A step of ``output`` took ``seconds``: decode-only steps teach the speculation
        policy what rows cost on this machine."""
        if self.spec_policy is None or not output.scheduled:
            return
        if all(item.is_decode for item in output.scheduled):
            self.spec_policy.observe_step(output.total_num_scheduled_tokens, seconds)

    @property
    def num_spec_declined_total(self) -> int:
        """Decoding requests the speculation policy gave no proposal although their limits
        allowed some (0 without adaptive speculation)."""
        return self.spec_policy.num_declined if self.spec_policy is not None else 0

    def _preemption_key(self, request: Request) -> tuple[int, int]:
        return preemption_key(self.config.policy, request)

    def _num_new_tokens(self, request: Request, budget: _StepBudget, num_cached: int = 0) -> int:
        """Tokens to compute this step, after the ``num_cached`` a prefix hit provides."""
        num_new = request.num_tokens - request.num_computed_tokens - num_cached
        available = budget.tokens if num_new == 1 else budget.for_prefill()
        if request.is_pooling:
            if budget.prefill_tokens == budget.prefill_cap:
                available = budget.tokens  # the step's first prefill: past the cap if need be
            return num_new if num_new <= available else 0
        if self.config.enable_chunked_prefill:
            return min(num_new, available)
        return num_new if num_new <= available else 0

    def _schedule_running(
        self, request: Request, budget: _StepBudget, output: SchedulerOutput
    ) -> None:
        num_new = self._num_new_tokens(request, budget)
        if num_new == 0:
            return
        if self.proposer is not None and num_new == 1:
            budget.decodes_left = max(budget.decodes_left - 1, 0)
            proposals = self._propose(request, budget)
            # Proposals only take blocks that are free: short of them, decode plainly.
            kv = self.kv_cache_manager
            if proposals and kv.allocate_slots(request, 1 + len(proposals)) is not None:
                self._add_to_output(request, 1, budget, output, proposals)
                return
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = max(self.running, key=self._preemption_key)
            self._preempt(victim, budget, output)
            if victim is request:
                return
        self._add_to_output(request, num_new, budget, output)

    def _schedule_waiting(self, budget: _StepBudget, output: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        # Prefix blocks this step computes; stale entries left by a later preemption
        # only cost a request one step of waiting.
        filling = {
            block_hash
            for item in output.scheduled
            for block_hash in kv.hashes_filled_by(item.request, item.num_new_tokens)
        }
        while self.waiting and budget.for_prefill() > 0:
            request = self.waiting.peek()
            # A pooled vector, or prompt logprobs, need every token's hidden state: no
            # prefix is skipped (the request's own blocks are still cached for others).
            computes_all = request.is_pooling or request.num_prompt_logprobs is not None
            hit = NO_HIT if computes_all else kv.get_computed_blocks(request)
            if hit.next_block_hash is not None and hit.next_block_hash in filling:
                break  # next step that block is cached; computing it twice wastes the budget
            num_new = self._num_new_tokens(request, budget, hit.num_tokens)
            if num_new == 0:
                break
            if len(self.running) >= self.config.max_num_seqs and not self._preempt_lower_priority(
                request, budget, output
            ):
                break
            while request.num_preemptions and not self._fits_to_the_end(request, hit):
                if not self._preempt_lower_priority(request, budget, output):
                    return  # it waits at the head: nothing newer takes the blocks it needs
            while kv.allocate_slots(request, num_new, hit.blocks) is None:
                if not self._preempt_lower_priority(request, budget, output):
                    return
            self.waiting.pop()
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if not request.is_pooling:  # its blocks are never cached
                filling.update(kv.hashes_filled_by(request, num_new))
            self._add_to_output(request, num_new, budget, output)

    def _propose(self, request: Request, budget: _StepBudget) -> list[int]:
        """Proposals for a request about to decode, within its limits and the step's budget.

        Never more than could be kept: the last proposal's position stays inside
        ``max_model_len`` and before the token that would reach ``max_tokens``.
        """
        assert self.proposer is not None and self.speculative_config is not None
        if request.grammar is not None or request.is_pooling:
            return []
        num_proposals = min(
            self.speculative_config.num_speculative_tokens,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens,
            budget.tokens - 1 - budget.decodes_left,
        )
        if self.spec_policy is not None:
            num_proposals = self.spec_policy.num_proposals(request.request_id, num_proposals)
        if num_proposals < 1:
            return []
        proposals = self.proposer.propose(request.request_id, request.all_token_ids, num_proposals)
        if self.spec_policy is not None:
            self.spec_policy.add_rows(len(proposals))
        return proposals

    def _fits_to_the_end(self, request: Request, hit: ComputedBlocks) -> bool:
        """Whether a preempted request can be readmitted without being preempted again."""
        return fits_to_the_end(
            request,
            hit,
            self.running,
            self.kv_cache_manager,
            self._preemption_key,
            self.max_model_len,
            self.config.max_num_batched_tokens,
        )

    def _preempt_lower_priority(
        self, request: Request, budget: _StepBudget, output: SchedulerOutput
    ) -> bool:
        """Under ``priority``, preempt the least important running request if below ``request``."""
        if self.config.policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=self._preemption_key)
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, budget, output)
        return True

    def _add_to_output(
        self,
        request: Request,
        num_new: int,
        budget: _StepBudget,
        output: SchedulerOutput,
        proposals: list[int] | None = None,
    ) -> None:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        # An embedding request is pooled at the end of its step, never sampled.
        samples = request.num_computed_tokens + num_new == request.num_tokens
        samples = samples and not request.is_pooling
        is_decode = num_new == 1 and request.num_computed_tokens >= request.num_prompt_tokens
        if proposals:
            item = ScheduledRequest(request, 1 + len(proposals), block_ids, True, True, proposals)
            output.scheduled.append(item)
            budget.tokens -= item.num_new_tokens
            return
        output.scheduled.append(ScheduledRequest(request, num_new, block_ids, samples, is_decode))
        budget.tokens -= num_new
        if num_new > 1:
            budget.prefill_tokens -= num_new

    def _preempt(self, victim: Request, budget: _StepBudget, output: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the victim's KV, keep its tokens, requeue it."""
        for index, item in enumerate(output.scheduled):
            if item.request is victim:
                # Already scheduled in this step: give its share of the step back.
                del output.scheduled[index]
                budget.tokens += item.num_new_tokens
                if item.num_new_tokens > 1 and not item.spec_token_ids:
                    budget.prefill_tokens += item.num_new_tokens
                break
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.add_preempted(victim)
        output.preempted_request_ids.append(victim.request_id)
        self.num_preemptions_total += 1

    # ------------------------------------------------------ after the forward

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        verified_token_ids: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply token-level stops.

        ``sampled_token_ids`` maps each request that sampled this step to its
        new token; ``verified_token_ids`` each request that verified proposals
        to the tokens it emits (the accepted proposals, then one more), cut
        here, in place, after the first that stops the request. Returns the
        requests that finished in this step (their blocks are already free).
        """
        finished = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            if item.spec_token_ids:
                if self._apply_verified(item, verified_token_ids or {}):
                    finished.append(request)
                continue
            request.num_computed_tokens += item.num_new_tokens
            if request.is_pooling:
                # Pooled in this step (the runner's output carries the vector): done, and
                # its blocks, never cached (an encoder writes no K/V), go back at once.
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
                continue
            self.kv_cache_manager.cache_blocks(request)
            self.kv_cache_manager.release_unreachable_blocks(request)
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return finished

    def _apply_verified(self, item: ScheduledRequest, verified: dict[str, list[int]]) -> bool:
        """Keep a verifying request's emitted tokens and roll back the rest; True if it finished.

        Tokens are appended one by one with the stop checks of a plain decode,
        so the request ends where it would have without speculation.
        """
        request = item.request
        tokens = verified.get(request.request_id, [])
        start = request.num_computed_tokens  # the position of the step's first token
        # Emitted tokens before the last were accepted proposals (counted before any stop).
        self.num_spec_proposed_total += len(item.spec_token_ids)
        self.num_spec_accepted_total += max(len(tokens) - 1, 0)
        if self.spec_policy is not None:
            self.spec_policy.observe_verification(
                request.request_id, len(item.spec_token_ids), max(len(tokens) - 1, 0)
            )
        status = None
        for index, token_id in enumerate(tokens):
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                del tokens[index + 1 :]
                break
        num_kept = max(len(tokens) - 1, 0)  # the proposals kept, up to a stop
        # K/V is right for the step's first token and the kept proposals; the last
        # emitted token (never an input of this step) is computed next step.
        request.num_computed_tokens = min(start + 1 + num_kept, request.num_tokens - 1)
        kv = self.kv_cache_manager
        kv.cache_blocks(request)
        kv.release_unreachable_blocks(request)
        kv.free_blocks_past(request, request.num_tokens)
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
            return True
        return False

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in (params.stop_token_ids or ()):
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_finished:
            request.grammar_completed = True  # the output is complete: nothing may follow
            return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if self.spec_policy is not None:
            self.spec_policy.forget(request.request_id)
        if self.proposer is not None:
            # What the request wrote helps later ones guess; an output cut by an error may not.
            kept = request.output_token_ids if status != RequestStatus.FINISHED_ERROR else []
            self.proposer.finish_request(request.request_id, kept)
        request.status = status
        request.grammar = None
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The proposer ``config.method`` names (None without speculation).

    Only the methods that need no model: the engine builds the draft model's.
    """
    if config is None:
        return None
    if config.method == "draft_model":
        raise ValueError("the draft_model proposer runs a model: the engine builds it")
    if config.method == "suffix":
        return SuffixProposer(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_min_token_prob,
        )
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
