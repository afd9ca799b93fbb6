"""Request checks: a prompt to token ids, and whether a request could ever run.

A :class:`RequestValidator` is built by the engine (:class:`~kvserve.engine.LLMEngine`)
and by the Ray ingress's ``EngineFront``, which has the tokenizer and the
replicas' limits but no model: both check with the same code, so they can
never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import TYPE_CHECKING

from kvserve.config import EngineConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import check_priority_and_salt
from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.engine_client import EngineLimits, PromptType, TokenizedPrompt
from kvserve.errors import InvalidParameterError
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.structured import COMPILE_TIMEOUT_S, CompiledGrammar, GrammarCompiler

if TYPE_CHECKING:
    from kvserve.loader.fast_tokenizer import AnyTokenizer


def resolve_max_model_len(config: EngineConfig, model_len: int) -> int:
    """The configured ``max_model_len``, or the model's context length ``model_len``."""
    requested = config.model_config.max_model_len
    if requested is None:
        return model_len
    if requested > model_len:
        raise InvalidParameterError(
            "max_model_len",
            f"must be at most the model's context length {model_len}, got {requested}",
        )
    return requested


class RequestValidator:
    """Tokenizing and checking requests, before anything is queued; changes nothing.

    limits: the engine's context length, vocabulary and KV cache size.
    scheduler_config: the policy (priorities), the step's token budget and chunked prefill.
    kv_cache_manager: bookkeeping that says whether a request's tokens could ever fit in
        the KV cache; only asked, never changed.
    grammar_compiler: compiles (and caches) structured-outputs specs.
    """

    def __init__(
        self,
        limits: EngineLimits,
        tokenizer: AnyTokenizer,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        grammar_compiler: GrammarCompiler,
    ) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self._scheduler_config = scheduler_config
        self._kv_cache_manager = kv_cache_manager
        self._grammar_compiler = grammar_compiler

    def tokenize_prompt(self, prompt: PromptType) -> TokenizedPrompt:
        """Prompt text (if given as text) and its token ids, checked against the vocabulary."""
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                token_ids = self._check_token_ids(prompt["prompt_token_ids"])
                return TokenizedPrompt(prompt.get("prompt"), token_ids)
            if "prompt" in prompt:
                return self.tokenize_prompt(str(prompt["prompt"]))
            raise InvalidParameterError(
                "prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'"
            )
        else:
            text, token_ids = None, self._check_token_ids(prompt)
        if not token_ids:
            raise InvalidParameterError("prompt", "must not be empty")
        return TokenizedPrompt(text, token_ids)

    def _check_token_ids(self, token_ids: object) -> list[int]:
        vocab_size = self.limits.vocab_size
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
            raise InvalidParameterError("prompt_token_ids", "must be a list of token ids")
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidParameterError(
                    "prompt_token_ids", f"must hold integers, got {token_id!r}"
                )
            if not 0 <= token_id < vocab_size:
                raise InvalidParameterError(
                    "prompt_token_ids", f"token id {token_id} is outside [0, {vocab_size})"
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
        if not self.limits.generates:
            raise InvalidParameterError(
                "model", "is an embedding model (an encoder): it does not generate text"
            )
        scheduler_config = self._scheduler_config
        check_priority_and_salt(priority, cache_salt, scheduler_config.policy)
        params.check_vocab(self.limits.vocab_size)
        max_model_len = self.limits.max_model_len
        num_prompt = len(prompt_token_ids)
        if num_prompt >= max_model_len:
            raise InvalidParameterError(
                "prompt",
                f"has {num_prompt} tokens; max_model_len is {max_model_len}, which must also "
                "leave room for at least one generated token",
            )
        total = num_prompt + params.max_tokens
        if total > max_model_len:
            raise InvalidParameterError(
                "max_tokens",
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len {max_model_len}",
            )
        manager = self._kv_cache_manager
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

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """The request, ready to queue, once :meth:`check_request` passes."""
        self.check_request(prompt_token_ids, params, cache_salt=cache_salt)
        return PreparedRequest(request_id, prompt, prompt_token_ids, params, cache_salt)

    def prepare_embedding(
        self, request_id: str, prompt: PromptType, pooling: PoolingParams, param: str = "prompt"
    ) -> PreparedRequest:
        """An embedding request ready to queue: tokenized, truncated where ``pooling`` asks,
        and checked (InvalidParameterError naming ``param``, ``dimensions`` or ``model``)."""
        limits = self.limits
        if not isinstance(pooling, PoolingParams):
            raise InvalidParameterError("pooling_params", "must be a PoolingParams")
        if limits.pooling is None:
            raise InvalidParameterError(
                "model", "takes no embedding requests; serve it with task 'embed' (--task embed)"
            )
        allowed = limits.pooling.allowed_dimensions()
        if pooling.dimensions is not None and pooling.dimensions not in allowed:
            raise InvalidParameterError(
                "dimensions",
                f"is {pooling.dimensions}; this model's vectors can only be "
                f"{', '.join(map(str, allowed))} long (it was not trained for other sizes)",
            )
        max_tokens = limits.max_embed_tokens
        keep = pooling.truncate_prompt_tokens
        if keep is not None:
            if keep > max_tokens:
                raise InvalidParameterError(
                    "truncate_prompt_tokens",
                    f"is {keep}; this model takes at most {max_tokens} tokens (or -1 for that)",
                )
            keep = max_tokens if keep == -1 else keep
        text, token_ids = self._embedding_tokens(prompt, keep, param)
        if len(token_ids) > max_tokens:
            raise InvalidParameterError(
                param,
                f"has {len(token_ids)} tokens; this model embeds at most {max_tokens} "
                "(set truncate_prompt_tokens to cut it)",
            )
        return PreparedRequest(
            request_id, text, token_ids, SamplingParams(max_tokens=1), pooling=pooling
        )

    def _embedding_tokens(
        self, prompt: PromptType, keep: int | None, param: str
    ) -> TokenizedPrompt:
        """The prompt's tokens, its first ``keep`` only when set: text is cut by the
        tokenizer, which keeps the special tokens around it; token ids are cut as given."""
        try:
            if isinstance(prompt, str) and keep is not None and prompt:
                ids = self.tokenizer(prompt, truncation=True, max_length=keep)["input_ids"]
                return TokenizedPrompt(prompt, list(ids))
            text, token_ids = self.tokenize_prompt(prompt)
        except InvalidParameterError as exc:
            raise InvalidParameterError(param, exc.message) from exc
        return TokenizedPrompt(text, token_ids if keep is None else token_ids[:keep])

    def compile_grammar(self, params: SamplingParams) -> futures.Future[CompiledGrammar] | None:
        """Start (or find in the cache) the compile of ``params``' structured-outputs spec.

        None when the request is unconstrained. The future raises
        InvalidParameterError for a spec that does not compile; callers that must
        refuse such a request before queuing it wait on it first. Thread-safe.
        """
        if params.structured_outputs is None:
            return None
        return self._grammar_compiler.compile(params.structured_outputs.spec)

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
