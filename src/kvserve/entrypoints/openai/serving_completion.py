"""``POST /v1/completions``: text in, text out, one or several prompts per request.

Each prompt runs as its own engine request with ``n`` sequences; choice
``i * n + j`` is the j-th completion of the i-th prompt, as in OpenAI's API.
Every prompt is tokenized and checked before any is queued.

``echo`` with ``logprobs`` returns the prompt's tokens and their logprobs
ahead of the completion's (the engine's prompt logprobs, asked with the same
top-k); a stream then holds each prompt's choices back until its prompt
logprobs are in, so that they come first.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.detokenizer import decode_tokens
from kvserve.engine.engine_client import PromptType
from kvserve.engine.output_stream import CompletionDelta, RequestDelta, RequestStream
from kvserve.entrypoints.openai.access_log import AccessLog
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.prompt_logprobs import echo_logprobs, prompt_logprobs_body
from kvserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobsBody,
)
from kvserve.entrypoints.openai.serving_base import ServingBase, new_request_id, sse
from kvserve.errors import InvalidParameterError
from kvserve.outputs import PromptLogprobs

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
    prompt_logprobs: PromptLogprobsBody | None = None  # vLLM's field, when asked


@dataclass
class _Call:
    """One /v1/completions request in flight."""

    body: CompletionRequest
    requests: list[PreparedRequest]
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.n = self.body.n or 1
        self.num_top_logprobs = self.body.logprobs or 0
        self.echo_logprobs = bool(self.body.echo) and self.body.logprobs is not None
        self._prompt_index = {r.request_id: i for i, r in enumerate(self.requests)}

    def choice_index(self, request_id: str, completion_index: int) -> int:
        return self._prompt_index[request_id] * self.n + completion_index

    def prompt_index(self, request_id: str) -> int:
        return self._prompt_index[request_id]


class CompletionServing(ServingBase):
    """Serves /v1/completions on an :class:`~kvserve.engine.engine_client.EngineClient`."""

    async def create(self, request: Request) -> Response:
        log = AccessLog(new_request_id("cmpl"), "/v1/completions", time.perf_counter())
        return await self.serve(request, log, lambda log: self._create(request, log))

    async def _create(self, request: Request, log: AccessLog) -> Response:
        body = await self.parse_body(request, CompletionRequest)
        self.check_common(body)
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
        deltas = await self.collect(request, stream, log)
        # Each prompt's logprobs, before any choice is built: they lead its choices.
        prompt_logprobs = {
            call.prompt_index(d.request_id): d.prompt_logprobs
            for d in deltas
            if d.prompt_logprobs is not None
        }
        choices: dict[int, _Choice] = {}
        for delta in deltas:
            for output in delta.outputs:
                index = call.choice_index(delta.request_id, output.index)
                if index not in choices:
                    found = prompt_logprobs.get(index // call.n)
                    choices[index] = self._new_choice(call, index, found)
                _extend(choices[index], output, call.num_top_logprobs)
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
                    prompt_logprobs=choice.prompt_logprobs,
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
            prompt_logprobs = body.prompt_logprobs
            if body.echo and body.logprobs is not None:
                # The echoed prompt's tokens carry as many alternatives as the completion's.
                prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
            params = self.sampling_params(
                body, max_tokens, body.logprobs, _RENAMES, prompt_logprobs=prompt_logprobs
            )
            request = self.prepare(
                f"{request_id}-{index}", token_ids, params, text, cache_salt, _RENAMES
            )
            prepared.append(request)
        return prepared

    def _new_choice(
        self, call: _Call, index: int, prompt_logprobs: PromptLogprobs | None = None
    ) -> _Choice:
        """Choice ``index``, led by its prompt (with ``echo``) and the prompt's logprobs
        (``prompt_logprobs``: the engine's, once computed)."""
        choice = _Choice()
        prepared = call.requests[index // call.n]
        if call.body.echo:
            choice.text = prepared.prompt or ""
        if call.body.logprobs is not None:
            choice.logprobs = CompletionLogprobs()
        if prompt_logprobs is None:
            return choice
        if call.body.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_body(prompt_logprobs)
        if call.echo_logprobs:
            choice.logprobs = echo_logprobs(
                prepared.prompt_token_ids,
                prompt_logprobs,
                call.num_top_logprobs,
                lambda ids: decode_tokens(self.tokenizer, ids),
            )
            choice.text_offset = len(choice.text)
        return choice

    async def _chunks(
        self, call: _Call, stream: RequestStream, log: AccessLog
    ) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        # Prompts whose choices wait for their prompt logprobs, with the deltas held back;
        # their first chunk (with the echoed prompt) is sent once the logprobs are in.
        waiting: dict[str, list[RequestDelta]] = {}
        if call.echo_logprobs or call.body.prompt_logprobs is not None:
            waiting = {r.request_id: [] for r in call.requests}
        elif call.body.echo:
            for index in range(len(call.requests) * call.n):
                choices[index] = self._new_choice(call, index)
                yield self._chunk(call, log, index, choices[index].text)
        async for delta in stream:
            log.count(delta)
            held = waiting.get(delta.request_id)
            if held is not None and delta.prompt_logprobs is None and not delta.finished:
                held.append(delta)
                continue
            waiting.pop(delta.request_id, None)
            if held is not None:
                for text in self._open_choices(call, choices, delta, log):
                    yield text
            for earlier in [*(held or []), delta]:
                for output in earlier.outputs:
                    index = call.choice_index(earlier.request_id, output.index)
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

    def _open_choices(
        self, call: _Call, choices: dict[int, _Choice], delta: RequestDelta, log: AccessLog
    ) -> list[str]:
        """The first chunk of each choice of ``delta``'s prompt, now that its prompt
        logprobs are in (or the prompt ended without them): the echoed prompt and its
        logprobs, and vLLM's ``prompt_logprobs`` when asked."""
        texts = []
        first = call.prompt_index(delta.request_id) * call.n
        for index in range(first, first + call.n):
            choice = self._new_choice(call, index, delta.prompt_logprobs)
            choices[index] = choice
            if call.body.echo or choice.prompt_logprobs is not None:
                texts.append(
                    self._chunk(
                        call, log, index, choice.text, choice.logprobs, None, choice.prompt_logprobs
                    )
                )
        return texts

    def _chunk(
        self,
        call: _Call,
        log: AccessLog,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None = None,
        output: CompletionDelta | None = None,
        prompt_logprobs: PromptLogprobsBody | None = None,
    ) -> str:
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=None if output is None else output.finish_reason,
            stop_reason=None if output is None else output.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )
        chunk = CompletionResponse(
            id=log.request_id,
            created=call.created,
            model=self.config.served_model_name,
            choices=[choice],
        )
        options = call.body.stream_options
        exclude: dict[str, Any] = (
            {} if options is not None and options.include_usage else {"usage": True}
        )
        if prompt_logprobs is None:
            exclude["choices"] = {0: {"prompt_logprobs"}}
        return sse(chunk.model_dump_json(exclude=exclude or None))


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
