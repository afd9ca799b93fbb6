"""``POST /v1/chat/completions``: a conversation, rendered with the model's chat template.

The template is applied exactly as ``LLM.chat`` does (text, then token ids
without extra special tokens), so a greedy answer over HTTP equals the
offline one. ``developer`` messages are treated as ``system`` messages, and
content given as a list of text parts is joined with newlines.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.chat.encode import encode_chat
from kvserve.engine.output_stream import CompletionDelta, RequestStream
from kvserve.entrypoints.openai.access_log import AccessLog
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.chat_answer import ChatAnswer
from kvserve.entrypoints.openai.prompt_logprobs import prompt_logprobs_body
from kvserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from kvserve.entrypoints.openai.serving_base import ServingBase, new_request_id, sse
from kvserve.entrypoints.openai.tool_calls import (
    TOOL_RENAMES,
    ToolMode,
    conversation,
    forced_call_constraint,
    tool_mode,
)
from kvserve.errors import ChatTemplateError, InvalidParameterError
from kvserve.outputs import Logprob, PromptLogprobs
from kvserve.sampling_params import SamplingParams


class StartedChat(NamedTuple):
    """A chat request checked and queued: its stream and what reading the answer needs."""

    stream: RequestStream
    mode: ToolMode | None
    num_top: int | None  # top logprobs per token; None without logprobs
    params: SamplingParams


class ChatServing(ServingBase):
    """Serves /v1/chat/completions on an :class:`~kvserve.engine.engine_client.EngineClient`."""

    async def create(self, request: Request) -> Response:
        log = AccessLog(new_request_id("chatcmpl"), "/v1/chat/completions", time.perf_counter())
        return await self.serve(request, log, lambda log: self._create(request, log))

    async def _create(self, request: Request, log: AccessLog) -> Response:
        body = await self.parse_body(request, ChatCompletionRequest)
        started = await self.start(request, body, log)
        stream, mode, num_top, params = started
        created = int(time.time())
        if body.stream:
            events = self._chunks(body, stream, log, created, num_top, mode)
            return self.event_stream(stream, events, log)
        texts = [""] * params.n
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(params.n)]
        finished: dict[int, CompletionDelta] = {}
        prompt_logprobs = None
        for delta in await self.collect(request, stream, log):
            if delta.prompt_logprobs is not None:
                prompt_logprobs = prompt_logprobs_body(delta.prompt_logprobs)
            for output in delta.outputs:
                texts[output.index] += output.text
                if num_top is not None:
                    logprobs[output.index] += _token_logprobs(output, num_top)
                if output.finish_reason is not None:
                    finished[output.index] = output
        choices = []
        for index in range(params.n):
            end = finished.get(index)
            end_reason = end.finish_reason if end else None
            message, reason = ChatAnswer(mode).message(texts[index], end_reason)
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=None if num_top is None else ChatLogprobs(content=logprobs[index]),
                    finish_reason=reason,
                    stop_reason=end.stop_reason if end else None,
                )
            )
        response = ChatCompletionResponse(
            id=log.request_id,
            created=created,
            model=self.config.served_model_name,
            choices=choices,
            usage=log.usage(),
            prompt_logprobs=prompt_logprobs,
        )
        return JSONResponse(response.model_dump())

    async def start(
        self, request: Request, body: ChatCompletionRequest, log: AccessLog
    ) -> StartedChat:
        """Check ``body``, render its prompt and queue it: everything before the answer.

        /v1/responses comes in here too, with its request turned into a chat request.
        """
        self.check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError.invalid("top_logprobs", "top_logprobs needs logprobs=true.")
        if len(body.messages) > self.config.max_chat_messages:
            raise ApiError.invalid(
                "messages",
                f"at most {self.config.max_chat_messages} messages, got {len(body.messages)}.",
            )
        mode = tool_mode(body)
        token_ids = await self.off_loop(self.render, body.messages, mode)
        max_tokens_field = "max_completion_tokens"
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens_field, max_tokens = "max_tokens", body.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens(len(token_ids))
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        renames = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs", "prompt": "messages"}
        forced = mode is not None and mode.forced
        constraint = None
        if mode is not None and mode.forced:
            constraint = forced_call_constraint(mode, body.parallel_tool_calls)
        params = self.sampling_params(
            body, max_tokens, num_top, renames, constraint, body.prompt_logprobs
        )
        salt = self.cache_salt(request, body)
        await self.compile_grammar(body, params, TOOL_RENAMES if forced else None)
        prepared = self.prepare(log.request_id, token_ids, params, None, salt, renames)
        log.num_prompt_tokens = len(token_ids)
        stream = await self.generate([prepared], log)
        return StartedChat(stream, mode, num_top, params)

    def render(
        self, messages: list[ChatMessage], mode: ToolMode | None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The conversation's prompt token ids, through the model's chat template.

        Runs on the tokenizer pool (see ``off_loop``).
        """
        template = self.tokenizer.chat_template
        if not template:
            raise ApiError.invalid(
                "messages",
                "This model has no chat template: it is a base model that completes text. "
                "Use /v1/completions, or start the server with --chat-template.",
            )
        has_tools = isinstance(template, str) and "tools" in template
        messages_in, tools = conversation(messages, mode, has_tools)
        try:
            return encode_chat(
                self.tokenizer,
                messages_in,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        except ChatTemplateError as exc:
            # The template refused these messages (roles out of order), failed on
            # them, or went past its limits: the template's fault or the request's,
            # never the server's; the tokenizer thread is free again either way.
            message = exc.message[0].upper() + exc.message[1:].rstrip(".") + "."
            raise ApiError.invalid("messages", message, code="chat_template") from None
        except InvalidParameterError as exc:  # a control token that is no text in this tokenizer
            raise ApiError.invalid("messages", f"The chat template refused them: {exc}") from None

    async def _chunks(
        self,
        body: ChatCompletionRequest,
        stream: RequestStream,
        log: AccessLog,
        created: int,
        num_top: int | None,
        mode: ToolMode | None,
    ) -> AsyncIterator[str]:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(
            choices: list[ChatStreamChoice],
            usage: bool = False,
            prompt_logprobs: PromptLogprobs | None = None,
        ) -> str:
            response = ChatCompletionChunk(
                id=log.request_id,
                created=created,
                model=self.config.served_model_name,
                choices=choices,
                usage=log.usage() if usage else None,
                prompt_logprobs=None
                if prompt_logprobs is None
                else prompt_logprobs_body(prompt_logprobs),
            )
            exclude = set() if include_usage else {"usage"}
            if prompt_logprobs is None:
                exclude.add("prompt_logprobs")
            return sse(response.model_dump_json(exclude=exclude or None))

        answers = [ChatAnswer(mode) for _ in range(body.n or 1)]
        for index in range(body.n or 1):
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatStreamChoice(index=index, delta=role)])
        async for delta in stream:
            log.count(delta)
            if delta.prompt_logprobs is not None:
                yield chunk([], prompt_logprobs=delta.prompt_logprobs)
            for output in delta.outputs:
                logprobs = None
                if num_top is not None and output.token_ids:
                    logprobs = ChatLogprobs(content=_token_logprobs(output, num_top))
                answer = answers[output.index]
                text, calls = answer.feed(output.text)
                if text or calls or logprobs is not None:
                    content = DeltaMessage(content=text, tool_calls=calls or None)
                    yield chunk(
                        [ChatStreamChoice(index=output.index, delta=content, logprobs=logprobs)]
                    )
                if output.finish_reason is not None:
                    text, calls, reason = answer.finish(output.finish_reason)
                    if text or calls:
                        rest = DeltaMessage(content=text or None, tool_calls=calls or None)
                        yield chunk([ChatStreamChoice(index=output.index, delta=rest)])
                    end = ChatStreamChoice(
                        index=output.index,
                        delta=DeltaMessage(),
                        finish_reason=reason,
                        stop_reason=output.stop_reason,
                    )
                    yield chunk([end])
        if include_usage:
            yield chunk([], usage=True)


def _token_logprobs(output: CompletionDelta, num_top: int) -> list[TokenLogprob]:
    """OpenAI's chat logprobs for the tokens of ``output``."""
    assert output.logprobs is not None
    result = []
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        top = sorted((e for e in entry.values() if e.rank <= num_top), key=lambda e: e.rank)
        result.append(
            TokenLogprob(**_top(entry[token_id]).model_dump(), top_logprobs=[_top(e) for e in top])
        )
    return result


def _top(entry: Logprob) -> TopLogprob:
    token = entry.decoded_token or ""
    return TopLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()))
