"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), for clients that count tokens.

``/tokenize`` takes a ``prompt`` (tokenized as ``/v1/completions`` does) or
chat ``messages`` (rendered as ``/v1/chat/completions`` does, tools
included), never both; ``/detokenize`` turns ids back into text. Neither
touches the engine: the work runs on the tokenizer pool.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.detokenizer import decode_tokens
from kvserve.entrypoints.openai.access_log import AccessLog
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.entrypoints.openai.serving_base import ServingBase, new_request_id
from kvserve.entrypoints.openai.serving_chat import ChatServing
from kvserve.entrypoints.openai.tool_calls import ToolMode


class TokenizeServing(ServingBase):
    """Serves /tokenize and /detokenize with the model's tokenizer and chat template."""

    def __init__(self, chat: ChatServing) -> None:
        super().__init__(chat.engine, chat.config, chat._tokenizer_pool)
        self._chat = chat

    async def tokenize(self, request: Request) -> Response:
        log = AccessLog(new_request_id("tokenize"), "/tokenize", time.perf_counter())
        return await self.serve(request, log, lambda log: self._tokenize(request))

    async def detokenize(self, request: Request) -> Response:
        log = AccessLog(new_request_id("detokenize"), "/detokenize", time.perf_counter())
        return await self.serve(request, log, lambda log: self._detokenize(request))

    async def _tokenize(self, request: Request) -> Response:
        body = await self.parse_body(request, TokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError.invalid("prompt", "Give either prompt or messages.")
        if body.messages is not None:
            if body.add_special_tokens:
                raise ApiError.invalid(
                    "add_special_tokens", "With messages the chat template adds special tokens."
                )
            if len(body.messages) > self.config.max_chat_messages:
                raise ApiError.invalid(
                    "messages", f"at most {self.config.max_chat_messages} messages."
                )
            mode = ToolMode("auto", tuple(body.tools)) if body.tools else None
            add_prompt = body.add_generation_prompt is not False
            tokens = await self.off_loop(self._chat.render, body.messages, mode, add_prompt)
        else:
            if body.tools is not None or body.add_generation_prompt is not None:
                raise ApiError.invalid("prompt", "tools and add_generation_prompt need messages.")
            special = body.add_special_tokens is not False
            tokens = await self.off_loop(self._encode, body.prompt, special)
        strs = None
        if body.return_token_strs:
            strs = list(await self.off_loop(self.tokenizer.convert_ids_to_tokens, tokens))
        response = TokenizeResponse(
            count=len(tokens),
            max_model_len=self.engine.limits.max_model_len,
            tokens=tokens,
            token_strs=strs,
        )
        return JSONResponse(response.model_dump())

    async def _detokenize(self, request: Request) -> Response:
        body = await self.parse_body(request, DetokenizeRequest)
        self._check_model(body.model)
        vocab_size = self.engine.limits.vocab_size
        for index, token in enumerate(body.tokens):
            if not 0 <= token < vocab_size:
                raise ApiError.invalid(
                    f"tokens[{index}]", f"token id {token} is outside [0, {vocab_size})."
                )
        text = await self.off_loop(decode_tokens, self.tokenizer, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    def _encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise ApiError.invalid(
                "model", f"The model '{model}' does not exist.", code="model_not_found"
            )
