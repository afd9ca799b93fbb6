"""The offline API: ``LLM(model).generate(prompts)``, ``LLM.chat(conversations)`` and
``LLM.embed(prompts)``.

Shaped like vLLM's ``LLM`` so code written for it switches by changing the import.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from tqdm import tqdm

from kvserve.chat.encode import encode_chat
from kvserve.config import EngineConfig
from kvserve.engine import LLMEngine, PromptType
from kvserve.errors import InvalidParameterError
from kvserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

Message = Mapping[str, str]
Conversation = Sequence[Message]


class LLM:
    """An engine for offline batches.

    ``LLM("smollm2-135m-instruct", dtype="float32", max_num_seqs=32)``: the
    keyword arguments are the fields of kvserve's config classes, by name.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        prompts: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of
            those (a bare list of ints is one tokenized prompt).
        sampling_params: one for all prompts, or one per prompt.
        priority: one for all prompts or one per prompt; lower runs first
            (needs ``policy="priority"``).
        cache_salt: one for all prompts or one per prompt; only prompts with
            the same salt share prefix-cache blocks.
        """
        prompt_list = self._as_prompt_list(prompts)
        num_prompts = len(prompt_list)
        params_list = self._as_params_list(sampling_params, num_prompts)
        priorities = _per_prompt("priority", priority, 0, num_prompts)
        salts = _per_prompt("cache_salt", cache_salt, None, num_prompts)
        requests = list(zip(prompt_list, params_list, priorities, salts, strict=True))
        # Validate everything before queuing anything: a bad prompt leaves the engine untouched.
        for prompt, params, prio, salt in requests:
            _, token_ids = self.llm_engine.validator.tokenize_prompt(prompt)
            self.llm_engine.validator.check_request(token_ids, params, prio, salt)
            self.llm_engine.validator.check_grammar(params)
        request_ids = []
        for prompt, params, prio, salt in requests:
            request_id = f"offline-{next(self._request_counter)}"
            self.llm_engine.add_request(request_id, prompt, params, cache_salt=salt, priority=prio)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        priority: int | Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them using the model's chat template.

        ``priority`` and ``cache_salt`` are as in :meth:`generate`, one for all
        conversations or one per conversation. ``chat_template`` (Jinja text)
        replaces the model's template; a model without one (a base model such
        as ``gemma3-270m``) needs it, or use :meth:`generate` on plain text.
        """
        conversations = (
            [cast(Conversation, messages)]
            if _is_conversation(messages)
            else cast(list[Conversation], list(messages))
        )
        prompts = [
            self.apply_chat_template(conv, add_generation_prompt, chat_template)
            for conv in conversations
        ]
        return self.generate(
            prompts, sampling_params, use_tqdm, priority=priority, cache_salt=cache_salt
        )

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in input order (the model's pooling; see ``--task``).

        Needs an embedding model (``LLM("all-minilm-l6-v2")``) or a decoder built
        with ``task="embed"``. All prompts are checked before any is queued;
        they are batched together, and beside whatever else the engine runs.
        truncate_prompt_tokens: as ``PoolingParams.truncate_prompt_tokens``, for
            every prompt whose params do not set it.
        """
        prompt_list = self._as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidParameterError(
                    "pooling_params",
                    f"got {len(params_list)} for {len(prompt_list)} prompts; pass one, or one "
                    "per prompt",
                )
        if truncate_prompt_tokens is not None:
            params_list = [
                p
                if p.truncate_prompt_tokens is not None
                else PoolingParams(p.dimensions, truncate_prompt_tokens)
                for p in params_list
            ]
        validator = self.llm_engine.validator
        prepared = [
            validator.prepare_embedding("check", prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        request_ids = []
        for request in prepared:
            request_id = f"offline-{next(self._request_counter)}"
            ids = {"prompt": request.prompt, "prompt_token_ids": request.prompt_token_ids}
            self.llm_engine.add_request(request_id, ids, pooling_params=request.pooling)
            request_ids.append(request_id)
        outputs = self._run(request_ids, use_tqdm)
        return [
            EmbeddingRequestOutput(
                output.request_id, EmbeddingOutput(output.embedding or []), output.prompt_token_ids
            )
            for output in outputs
        ]

    def apply_chat_template(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> dict[str, list[int]]:
        """The conversation as prompt token ids, rendered with ``chat_template`` or the model's."""
        if not conversation:
            raise InvalidParameterError("messages", "must not be empty")
        for message in conversation:
            if (
                not isinstance(message, Mapping)
                or "role" not in message
                or "content" not in message
            ):
                raise InvalidParameterError("messages", "each message needs 'role' and 'content'")
        tokenizer = self.llm_engine.tokenizer
        if not (chat_template or tokenizer.chat_template):
            raise InvalidParameterError(
                "chat_template",
                "this model has no chat template (a base model completes text: use "
                "generate()); pass one as chat(..., chat_template=...)",
            )
        # Message text stays text: only the template writes control tokens.
        token_ids = encode_chat(tokenizer, conversation, add_generation_prompt, chat_template)
        return {"prompt_token_ids": token_ids}

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        started = time.perf_counter()
        num_output_tokens = 0
        with tqdm(
            total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm
        ) as bar:
            while pending:
                for output in engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = time.perf_counter() - started
                        bar.set_postfix_str(f"output {num_output_tokens / elapsed:.1f} tok/s")
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, Mapping)):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
            return [cast(Sequence[int], prompts)]  # one prompt given as token ids
        if isinstance(prompts, Sequence) and prompts:
            return list(prompts)  # type: ignore[arg-type]
        raise InvalidParameterError("prompts", "must be a prompt or a non-empty list of prompts")

    @staticmethod
    def _as_params_list(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            raise InvalidParameterError(
                "sampling_params",
                f"got {len(params_list)} for {num_prompts} prompts; pass one, or one per prompt",
            )
        return params_list


def _per_prompt(param: str, value: Any, default: Any, num_prompts: int) -> list[Any]:
    """A scalar (or None, meaning ``default``) for every prompt, or a list of one per prompt."""
    if value is None:
        return [default] * num_prompts
    if isinstance(value, str) or not isinstance(value, Sequence):
        return [value] * num_prompts  # the engine checks each value's type and range
    values = list(value)
    if len(values) != num_prompts:
        raise InvalidParameterError(
            param, f"got {len(values)} for {num_prompts} prompts; pass one, or one per prompt"
        )
    return values


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


__all__ = ["LLM", "Conversation", "Message"]
