"""``POST /v1/completions``: text in, text out, one or several prompts per request.

Each prompt runs as its own engine request with ``n`` sequences; choice
``i * n + j`` is the j-th completion of the i-th prompt, as in OpenAI's API.
Every prompt is tokenized and checked before any is queued.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.detokenizer import decode_tokens
from kvserve.engine.engine_client import PromptType
from kvserve.engine.output_stream import CompletionDelta, RequestStream
from kvserve.entrypoints.openai.access_log import AccessLog
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvserve.entrypoints.openai.serving_base import ServingBase, new_request_id, sse
from kvserve.errors import InvalidParameterError

# Engine parameter names that the client knows under another name here.
_RENAMES = {"prompt_token_ids": "prompt"}


class _Tokenized(NamedTuple):
    """A prompt's text (None when given as token ids and not echoed) and token ids."""

    text: str | None
    token_ids: list[int]


@dataclass
class _Choice:
    """One choice being assembled from deltas."""

    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # where the next token's text starts, for logprobs.text_offset


@dataclass
class _Call:
    """One /v1/completions request in flight."""

    body: CompletionRequest
    requests: list[PreparedRequest]
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.n = self.body.n or 1
        self.num_top_logprobs = self.body.logprobs or 0
        self._prompt_index = {r.request_id: i for i, r in enumerate(self.requests)}

    def choice_index(self, request_id: str, completion_index: int) -> int:
        return self._prompt_index[request_id] * self.n + completion_index


class CompletionServing(ServingBase):
    """Serves /v1/completions on an :class:`~kvserve.engine.engine_client.EngineClient`."""

    async def create(self, request: Request) -> Response:
        log = AccessLog(new_request_id("cmpl"), "/v1/completions", time.perf_counter())
        return await self.serve(request, log, lambda log: self._create(request, log))

    async def _create(self, request: Request, log: AccessLog) -> Response:
        body = await self.parse_body(request, CompletionRequest)
        self.check_common(body)
        if body.echo and body.logprobs is not None:
            raise ApiError.invalid("echo", "echo together with logprobs is not supported.")
        if body.suffix:
            raise ApiError.invalid("suffix", "suffix is not supported.")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise ApiError.invalid("best_of", "best_of other than n is not supported.")
        prompts = _as_prompt_list(body.prompt)
        if len(prompts) > self.config.max_prompts_per_request:
            raise ApiError.invalid(
                "prompt",
                f"at most {self.config.max_prompts_per_request} prompts per request, "
                f"got {len(prompts)}.",
            )
        tokenized = await self.off_loop(self._tokenize_all, prompts, bool(body.echo))
        salt = self.cache_salt(request, body)
        call = _Call(body, self._prepare_all(body, tokenized, salt, log.request_id))
        # Every prompt of the call has the same constraint: one compile covers them all.
        await self.compile_grammar(body, call.requests[0].params)
        log.num_prompt_tokens = sum(len(r.prompt_token_ids) for r in call.requests)
        stream = await self.generate(call.requests, log)
        if body.stream:
            return self.event_stream(stream, self._chunks(call, stream, log), log)
        choices: dict[int, _Choice] = {}
        for delta in await self.collect(request, stream, log):
            for output in delta.outputs:
                index = call.choice_index(delta.request_id, output.index)
                choice = choices.setdefault(index, self._new_choice(call, index))
                _extend(choice, output, call.num_top_logprobs)
        response = CompletionResponse(
            id=log.request_id,
            created=call.created,
            model=self.config.served_model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text=choice.text,
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for index, choice in sorted(choices.items())
            ],
            usage=log.usage(),
        )
        return JSONResponse(response.model_dump())

    def _tokenize_all(self, prompts: list[PromptType], echo: bool) -> list[_Tokenized]:
        """Each prompt's text and token ids; runs on the tokenizer pool (see ``off_loop``).

        With ``echo``, a prompt given as token ids gets its text too, to echo back.
        """
        tokenized = []
        for prompt in prompts:
            try:
                text, token_ids = self.engine.tokenize(prompt)
            except InvalidParameterError as exc:
                raise ApiError.invalid("prompt", f"prompt: {exc.message}") from None
            if text is None and echo:
                text = decode_tokens(self.tokenizer, token_ids)
            tokenized.append(_Tokenized(text, token_ids))
        return tokenized

    def _prepare_all(
        self,
        body: CompletionRequest,
        prompts: list[_Tokenized],
        cache_salt: str | None,
        request_id: str,
    ) -> list[PreparedRequest]:
        prepared = []
        for index, (text, token_ids) in enumerate(prompts):
            max_tokens = body.max_tokens
            if max_tokens is None:
                max_tokens = self.default_max_tokens(len(token_ids))
            params = self.sampling_params(body, max_tokens, body.logprobs, _RENAMES)
            request = self.prepare(
                f"{request_id}-{index}", token_ids, params, text, cache_salt, _RENAMES
            )
            prepared.append(request)
        return prepared

    def _new_choice(self, call: _Call, index: int) -> _Choice:
        choice = _Choice()
        if call.body.echo:
            choice.text = call.requests[index // call.n].prompt or ""
        if call.body.logprobs is not None:
            choice.logprobs = CompletionLogprobs()
        return choice

    async def _chunks(
        self, call: _Call, stream: RequestStream, log: AccessLog
    ) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        if call.body.echo:
            for index in range(len(call.requests) * call.n):
                choices[index] = self._new_choice(call, index)
                yield self._chunk(call, log, index, choices[index].text)
        async for delta in stream:
            log.count(delta)
            for output in delta.outputs:
                index = call.choice_index(delta.request_id, output.index)
                choice = choices.setdefault(index, self._new_choice(call, index))
                logprobs = _extend(choice, output, call.num_top_logprobs)
                if output.text or logprobs is not None or output.finish_reason:
                    yield self._chunk(call, log, index, output.text, logprobs, output)
        options = call.body.stream_options
        if options is not None and options.include_usage:
            usage = CompletionResponse(
                id=log.request_id,
                created=call.created,
                model=self.config.served_model_name,
                choices=[],
                usage=log.usage(),
            )
            yield sse(usage.model_dump_json())

    def _chunk(
        self,
        call: _Call,
        log: AccessLog,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None = None,
        output: CompletionDelta | None = None,
    ) -> str:
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=None if output is None else output.finish_reason,
            stop_reason=None if output is None else output.stop_reason,
        )
        chunk = CompletionResponse(
            id=log.request_id,
            created=call.created,
            model=self.config.served_model_name,
            choices=[choice],
        )
        options = call.body.stream_options
        include_usage = options is not None and options.include_usage
        return sse(chunk.model_dump_json(exclude=None if include_usage else {"usage"}))


def _as_prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """One entry per prompt: text, or ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError.invalid("prompt", "prompt must not be empty.")
    if all(isinstance(item, int) for item in prompt):
        return [{"prompt_token_ids": prompt}]
    return [item if isinstance(item, str) else {"prompt_token_ids": item} for item in prompt]


def _extend(choice: _Choice, output: CompletionDelta, num_top: int) -> CompletionLogprobs | None:
    """Add ``output`` to ``choice``; return the logprobs of just this delta."""
    choice.text += output.text
    choice.finish_reason = output.finish_reason or choice.finish_reason
    choice.stop_reason = output.stop_reason if output.finish_reason else choice.stop_reason
    if choice.logprobs is None or output.logprobs is None:
        return None
    delta = CompletionLogprobs()
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        top = sorted((e for e in entry.values() if e.rank <= num_top), key=lambda e: e.rank)
        delta.tokens.append(token)
        delta.token_logprobs.append(sampled.logprob)
        delta.top_logprobs.append({e.decoded_token or "": e.logprob for e in top})
        delta.text_offset.append(choice.text_offset)
        choice.text_offset += len(token)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(choice.logprobs, name).extend(getattr(delta, name))
    return delta
