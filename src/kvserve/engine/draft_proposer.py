"""Draft-model speculation: a smaller model with the same tokenizer proposes what it would write.

``speculative_config={"method": "draft_model", "model": ...}``. The draft
runs in an engine of its own (:class:`~kvserve.engine.llm_engine.LLMEngine`):
its own KV pool, prefix cache, scheduler and decode fast path, in the
target's dtype, on the target's device, with the target's block size and
pool settings. To propose ``k`` tokens for a request, the request's tokens so
far become the draft engine's prompt and it generates ``k`` tokens greedily,
stepping until they are there. The draft's prefix cache keeps every full
block of the last round (prompt, accepted proposals and all), so a round
computes only the tokens since the last full block, then ``k - 1`` decodes.

Proposals are the draft's argmax, so their distribution is one-hot: the
rejection sampler (``sample/rejection_sampler.py``) keeps each with the
target's probability of it, and the output is distributed exactly as
without speculation; greedy output is the same tokens.

The draft's time is spent while the target's step is being scheduled, so it
counts in the step time that the adaptive policy (``core/spec_policy.py``)
measures: a draft that costs more than its accepted tokens save is turned
off by the policy as any other proposer would be.

Requests are proposed for one at a time, each in its own few draft steps;
batching the rounds of a step's requests into shared draft steps would cost
fewer passes over the draft's weights.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.config import EngineConfig, KVEventsConfig, ParallelConfig
from kvserve.errors import InvalidParameterError, ModelLoadError
from kvserve.loader import load_arch_config, load_tokenizer, resolve_model
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.loader.fast_tokenizer import AnyTokenizer

PARAM = "speculative_config.model"


def draft_engine_config(target: EngineConfig, draft_max_model_len: int) -> EngineConfig:
    """The draft engine's config: the target's precision, device, pool and step settings,
    one rank, no KV events or disk tier, and prefix caching on (each round reuses the
    last one's blocks) unless the draft has sliding-window layers."""
    spec = target.speculative_config
    assert spec is not None and spec.model is not None
    model_config = dataclasses.replace(
        target.model_config,
        model=spec.model,
        revision=None,
        max_model_len=draft_max_model_len,
        task="generate",
        pooling_type="auto",
    )
    cache_config = dataclasses.replace(
        target.cache_config,
        enable_prefix_caching=None,  # on, unless the draft has sliding-window layers
        prefix_cache_dir=None,
        prefix_cache_disk_bytes=None,
    )
    # Chunked prefill always: a round's prompt is the whole context, which may be longer
    # than one step's budget even where the target's prompts never were.
    scheduler_config = dataclasses.replace(
        target.scheduler_config, policy="fcfs", enable_chunked_prefill=True
    )
    return EngineConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=ParallelConfig(),
        kv_events_config=KVEventsConfig(),
        speculative_config=None,
    )


def check_same_vocabulary(target: AnyTokenizer, draft: AnyTokenizer, draft_vocab_size: int) -> None:
    """Refuse a draft whose token ids mean other text than the target's, or whose LM head
    cannot produce every token of the tokenizer."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            token
            for token in target_vocab.keys() | draft_vocab.keys()
            if target_vocab.get(token) != draft_vocab.get(token)
        )
        raise InvalidParameterError(
            PARAM,
            f"the draft model's tokenizer differs from the target's ({len(draft_vocab)} tokens "
            f"against {len(target_vocab)}; {len(differing)} differ, e.g. {differing[:5]!r}); "
            "a draft model must share the target's vocabulary",
        )
    if draft_vocab_size < len(target_vocab):
        raise InvalidParameterError(
            PARAM,
            f"the draft model's LM head has {draft_vocab_size} rows, fewer than the "
            f"{len(target_vocab)} tokens of the shared tokenizer",
        )


def draft_config(
    target_config: EngineConfig,
    target_tokenizer: AnyTokenizer,
    target_max_model_len: int,
) -> EngineConfig:
    """The draft engine's config, after checking that the draft (``speculative_config.model``)
    loads and shares the target's vocabulary; reads only its config and tokenizer.

    Raises :class:`InvalidParameterError` naming ``speculative_config.model``.
    """
    spec = target_config.speculative_config
    if spec is None or spec.method != "draft_model" or spec.model is None:
        raise ValueError("a draft model needs speculative_config.method 'draft_model'")
    try:
        source = resolve_model(spec.model)
        arch = load_arch_config(source)
        tokenizer = load_tokenizer(source)
    except ModelLoadError as exc:
        raise InvalidParameterError(PARAM, f"cannot load the draft model: {exc}") from exc
    check_same_vocabulary(target_tokenizer, tokenizer, arch.vocab_size)
    return draft_engine_config(
        target_config, min(target_max_model_len, arch.max_position_embeddings)
    )


class DraftModelProposer:
    """Greedy proposals from a draft model in its own engine (see the module docstring).

    engine: the draft's engine (config from :func:`draft_config`).
    target_vocab_size: the target's LM head rows; a proposal the target could not
        verify (an id past them) ends the proposals.
    """

    def __init__(self, engine: LLMEngine, target_vocab_size: int) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.target_vocab_size = target_vocab_size
        self._round_ids = itertools.count()
        self._params: dict[int, SamplingParams] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The draft's greedy continuation of ``token_ids``, up to ``num_tokens`` tokens
        ([] when the context does not fit the draft)."""
        num_tokens = min(num_tokens, self.max_model_len - len(token_ids))
        if num_tokens < 1 or not token_ids:
            return []
        engine = self.engine
        # A fresh id per round: a round always ends before the next begins, but an id
        # that only this proposer makes cannot clash with anything left behind.
        round_id = f"{request_id}#draft{next(self._round_ids)}"
        try:
            engine.add_request(
                round_id, {"prompt_token_ids": list(token_ids)}, self._greedy(num_tokens)
            )
        except InvalidParameterError:
            return []  # a token the draft cannot read, or a context past its pool: no guess
        proposals: list[int] = []
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id == round_id and output.finished:
                        proposals = list(output.outputs[0].token_ids)
        finally:
            engine.abort_request(round_id)  # only if a step raised: a finished round is gone
        for index, token_id in enumerate(proposals):
            if token_id >= self.target_vocab_size:
                return proposals[:index]
        return proposals

    def finish_request(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """Nothing to forget: a request's rounds leave only cached blocks, which the draft's
        prefix cache evicts as it needs room."""

    def forget_outputs(self) -> None:
        """Empty the draft's prefix cache: an earlier answer's blocks are all it keeps."""
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release what the draft engine holds outside its memory."""
        self.engine.shutdown()

    def _greedy(self, num_tokens: int) -> SamplingParams:
        params = self._params.get(num_tokens)
        if params is None:
            params = SamplingParams(
                temperature=0.0, max_tokens=num_tokens, ignore_eos=True, skip_special_tokens=False
            )
            self._params[num_tokens] = params
        return params
