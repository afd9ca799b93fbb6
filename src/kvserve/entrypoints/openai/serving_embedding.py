"""``POST /v1/embeddings``: one vector per input, from the engine that embeds the named model.

A server has one engine, or a generator and an embedding model side by side
(``kvserve serve --model ... --embedding-model all-minilm-l6-v2``): each is
an :class:`EmbeddingServing` under its served name, and the request's
``model`` picks one (omitted: the only engine that embeds). The inputs of
one request are queued together, so the engine batches them in its steps,
beside whatever else it runs; each is checked before any is queued (a
prompt past the model's limit is a 400 naming ``input``, unless the
request sets ``truncate_prompt_tokens``; ``dimensions`` only where the
model was trained for shorter vectors).
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.engine_client import PromptType
from kvserve.entrypoints.openai.access_log import AccessLog
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from kvserve.entrypoints.openai.serving_base import ServingBase, new_request_id
from kvserve.errors import InvalidParameterError
from kvserve.pooling_params import PoolingParams


class EmbeddingServing(ServingBase):
    """Serves ``/v1/embeddings`` for one engine (the model ``config.served_model_name``)."""

    @property
    def embeds(self) -> bool:
        return self.engine.limits.pooling is not None

    async def create(self, request: Request, body: EmbeddingRequest, log: AccessLog) -> Response:
        inputs = _as_inputs(body.input)
        if len(inputs) > self.config.max_prompts_per_request:
            raise ApiError.invalid(
                "input",
                f"at most {self.config.max_prompts_per_request} inputs per request, "
                f"got {len(inputs)}.",
            )
        try:
            pooling = PoolingParams(body.dimensions, body.truncate_prompt_tokens)
        except InvalidParameterError as exc:
            raise ApiError.invalid(exc.param, f"{exc.param}: {exc.message}") from None
        requests = await self.off_loop(self._prepare_all, inputs, pooling, log.request_id)
        log.num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        stream = await self.generate(requests, log)
        vectors: dict[str, list[float]] = {}
        for delta in await self.collect(request, stream, log):
            if delta.embedding is not None:
                vectors[delta.request_id] = delta.embedding
        data = [
            EmbeddingData(index=index, embedding=_encoded(vectors[r.request_id], body))
            for index, r in enumerate(requests)
        ]
        usage = EmbeddingUsage(
            prompt_tokens=log.num_prompt_tokens, total_tokens=log.num_prompt_tokens
        )
        response = EmbeddingResponse(data=data, model=self.config.served_model_name, usage=usage)
        return JSONResponse(response.model_dump())

    def _prepare_all(
        self, inputs: list[PromptType], pooling: PoolingParams, request_id: str
    ) -> list[PreparedRequest]:
        """Every input tokenized and checked; runs on the tokenizer pool."""
        prepared = []
        for index, prompt in enumerate(inputs):
            try:
                prepared.append(
                    self.engine.prepare_embedding(f"{request_id}-{index}", prompt, pooling, "input")
                )
            except InvalidParameterError as exc:
                param = "input" if exc.param == "prompt_token_ids" else exc.param
                raise ApiError.invalid(param, f"{param}: {exc.message}") from None
        return prepared


class EmbeddingRouter:
    """The server's ``/v1/embeddings``: routes each request to its model's engine."""

    def __init__(self, servings: list[EmbeddingServing]) -> None:
        self._servings = {s.config.served_model_name: s for s in servings}

    async def create(self, request: Request) -> Response:
        log = AccessLog(new_request_id("embd"), "/v1/embeddings", time.perf_counter())

        async def handle(log: AccessLog) -> Response:
            first = next(iter(self._servings.values()))
            body = await first.parse_body(request, EmbeddingRequest)
            return await self._serving_for(body.model).create(request, body, log)

        return await next(iter(self._servings.values())).serve(request, log, handle)

    def _serving_for(self, model: str | None) -> EmbeddingServing:
        embedders = [s for s in self._servings.values() if s.embeds]
        if model is None:
            if embedders:
                return embedders[0]
        elif model in self._servings:
            serving = self._servings[model]
            if serving.embeds:
                return serving
            raise ApiError.invalid(
                "model",
                f"The model '{model}' generates text and was not started to embed "
                "(serve it with --task embed, or add --embedding-model).",
                code="model_not_embedding",
            )
        names = ", ".join(repr(s.config.served_model_name) for s in embedders) or "none"
        raise ApiError.invalid(
            "model",
            f"The model '{model}' does not exist here; models serving embeddings: {names}.",
            code="model_not_found",
        )


def _as_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """The request's inputs, one prompt each; a flat list of ints is one tokenized input."""
    if isinstance(value, str):
        inputs: list[PromptType] = [value]
    elif value and all(isinstance(item, int) for item in value):
        inputs = [list(value)]  # type: ignore[arg-type]
    else:
        inputs = list(value)  # type: ignore[arg-type]
    if not inputs:
        raise ApiError.invalid("input", "input: must not be empty.")
    for item in inputs:
        if not item:
            raise ApiError.invalid("input", "input: an input must not be empty.")
    return inputs


def _encoded(vector: list[float], body: EmbeddingRequest) -> list[float] | str:
    if body.encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
