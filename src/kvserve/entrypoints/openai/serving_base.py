"""What the completion and chat endpoints share.

Reading the body under its size limit, the model name and ``n`` checks,
``SamplingParams`` from the request (with errors renamed to the field the
client sent), the request's cache salt, tokenizer work off the event loop,
running a request to its end while watching for the client to leave,
Server-Sent Events, and writing the access-log line in every outcome.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from kvserve.engine.async_commands import PreparedRequest
from kvserve.engine.async_errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from kvserve.engine.engine_client import EngineClient
from kvserve.engine.output_stream import RequestDelta, RequestStream
from kvserve.entrypoints.openai import auth
from kvserve.entrypoints.openai.access_log import BODY_TIMEOUT_SCOPE_KEY, AccessLog
from kvserve.entrypoints.openai.api_errors import ApiError, engine_error, require_json_body
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.entrypoints.openai.structured_request import (
    RESPONSE_FORMAT_RENAMES,
    compile_before_queuing,
    structured_outputs,
)
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredOutputsParams

RequestT = TypeVar("RequestT", bound=BaseModel)
ResultT = TypeVar("ResultT")

# Sampling fields passed to SamplingParams under the same name when the client set them.
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# HTTP 499 (nginx's "client closed request") in the access log when the client left.
STATUS_CLIENT_CLOSED = 499
# The access log's status when the server cut off a body that did not arrive in time
# (connection_limits.py; the client got 408 if it was still listening).
STATUS_BODY_TIMEOUT = 408


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def sse(payload: str) -> str:
    """One Server-Sent Event carrying ``payload`` (JSON, or ``[DONE]``)."""
    return f"data: {payload}\n\n"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ServingBase:
    """Request handling shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    def __init__(
        self, engine: EngineClient, config: ServerConfig, tokenizer_pool: Executor
    ) -> None:
        """``tokenizer_pool`` runs tokenizer work; it must never run a torch operation."""
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self._tokenizer_pool = tokenizer_pool
        self.max_sequence_len = engine.limits.max_sequence_len

    async def parse_body(self, request: Request, model: type[RequestT]) -> RequestT:
        """The body as ``model``; 415 unless JSON, 413 past the size limit, 400 when malformed.

        Raises ClientDisconnected when the client leaves (or is cut off) before its body is in.
        """
        require_json_body(request)
        limit = self.config.max_request_body_bytes
        declared = request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > limit:
            raise _too_large(limit)
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:  # a chunked body has no Content-Length to check up front
                    raise _too_large(limit)
        except ClientDisconnect:
            raise ClientDisconnected from None
        try:
            return model.model_validate_json(bytes(body))
        except ValidationError as exc:
            raise ApiError.from_validation(exc.errors()) from None

    async def off_loop(self, work: Callable[..., ResultT], *args: Any) -> ResultT:
        """``work(*args)`` on the tokenizer pool, so a huge prompt stalls no other client.

        Only tokenizer work goes there (text to ids, chat templates, ids to text):
        a torch operation on another thread would start an OpenMP team beside the
        engine loop's and slow every step (see ``engine/own_thread.py``).
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, functools.partial(work, *args))

    def check_common(self, body: Any) -> None:
        """The checks every endpoint makes: model name, ``n`` and list caps, unsupported options."""
        if body.model is not None and body.model != self.config.served_model_name:
            raise ApiError.invalid(
                "model",
                f"The model '{body.model}' does not exist; this server serves "
                f"'{self.config.served_model_name}'.",
                code="model_not_found",
            )
        if not self.engine.limits.generates:
            raise ApiError.invalid(
                "model",
                f"The model '{self.config.served_model_name}' is an embedding model: it serves "
                "/v1/embeddings only.",
                code="model_not_generating",
            )
        if body.n is not None and body.n > self.config.max_n:
            raise ApiError.invalid("n", f"n must be at most {self.config.max_n}, got {body.n}.")
        limit = self.config.max_stop_token_ids
        if body.stop_token_ids is not None and len(body.stop_token_ids) > limit:
            raise ApiError.invalid(
                "stop_token_ids",
                f"at most {limit} stop_token_ids, got {len(body.stop_token_ids)}.",
            )
        if body.stream_options is not None and not body.stream:
            raise ApiError.invalid("stream_options", "stream_options needs stream=true.")
        if body.logit_bias:
            raise ApiError.invalid("logit_bias", "logit_bias is not supported.")

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Without max_tokens, a request may run to the end of the context."""
        return max(1, self.max_sequence_len - num_prompt_tokens)

    def sampling_params(
        self,
        body: Any,
        max_tokens: int,
        logprobs: int | None,
        renames: Mapping[str, str],
        constraint: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams from the request; a bad value names the field the client sent.

        constraint: the output's constraint when it does not come from the
        request's response_format or structured_outputs (a forced tool call).
        prompt_logprobs: how many top alternatives each prompt token's logprob
            comes with (None: no prompt logprobs).
        """
        values = {name: getattr(body, name) for name in _SAMPLING_FIELDS}
        values = {name: value for name, value in values.items() if value is not None}
        values["structured_outputs"] = constraint or structured_outputs(body)[0]
        try:
            return SamplingParams(
                **values,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except InvalidParameterError as exc:
            raise _renamed(exc, renames) from None

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        cache_salt: str | None,
        renames: Mapping[str, str],
    ) -> PreparedRequest:
        """The request checked by the engine; ``cache_salt`` is from :meth:`cache_salt`."""
        try:
            return self.engine.prepare(request_id, prompt_token_ids, params, prompt, cache_salt)
        except InvalidParameterError as exc:
            raise _renamed(exc, renames) from None

    async def compile_grammar(
        self, body: Any, params: SamplingParams, renames: dict[str, str] | None = None
    ) -> None:
        """Compile the request's grammar before queuing it; a 400 if it does not compile.

        renames: the fields compile errors name (by default the request's
        response_format or structured_outputs).
        """
        if renames is None:
            renames = RESPONSE_FORMAT_RENAMES if body.structured_outputs is None else {}
        await compile_before_queuing(self.engine, params, renames)

    def cache_salt(self, request: Request, body: Any) -> str | None:
        """The request's prefix-cache salt: its API key's (when salted by key) and its own."""
        return auth.cache_salt(request, body.cache_salt)

    async def generate(self, requests: list[PreparedRequest], log: AccessLog) -> RequestStream:
        """Queue the requests; 503 when the queue is full or the engine is down, 400 when
        they have more sequences than may ever wait.

        Returns once the engine has accepted them, before any response starts: a
        remote engine (serve/ray/) answers a moment later, and its refusal must
        still be the response's status, streamed or not.
        """
        try:
            stream = self.engine.generate(requests)
            await stream.accepted()
        except InvalidParameterError as exc:  # more sequences than may ever wait
            raise _renamed(exc, {}) from None
        # Failed: a remote engine's replica was lost before it answered.
        except (EngineOverloadedError, EngineDeadError, RequestFailedError) as exc:
            raise self._error(exc, log) from None
        return stream

    async def collect(
        self, request: Request, stream: RequestStream, log: AccessLog
    ) -> list[RequestDelta]:
        """Every delta until the requests finish; aborts them if the client leaves first."""

        async def drain() -> list[RequestDelta]:
            deltas = []
            async for delta in stream:
                log.count(delta)  # as they come, so the log's time to first token is right
                deltas.append(delta)
            return deltas

        async with stream:
            work = asyncio.ensure_future(drain())
            client_gone = asyncio.ensure_future(_wait_for_disconnect(request))
            try:
                await asyncio.wait({work, client_gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                client_gone.cancel()
                work.cancel()  # no-op when done; leaving `async with` aborts the requests
            if not work.done() or work.cancelled():
                raise ClientDisconnected
            try:
                return work.result()
            except (RequestFailedError, EngineDeadError) as exc:
                raise self._error(exc, log) from None

    def event_stream(
        self,
        stream: RequestStream,
        events: AsyncIterator[str],
        log: AccessLog,
        error_event: Callable[[ApiError], str] | None = None,
        last_event: str | None = sse("[DONE]"),
    ) -> StreamingResponse:
        """An SSE response of ``events`` then ``last_event``; a failure becomes an error event.

        error_event: the event reporting a failure (by default OpenAI's error body).
        """

        async def body() -> AsyncIterator[str]:
            try:
                async with stream:
                    async for event in events:
                        yield event
            except Exception as exc:
                # Headers (200) are out: the failure can only be reported in the stream.
                error = self._error(exc, log)
                log.status = error.status_code
                yield sse(json.dumps(error.body())) if error_event is None else error_event(error)
            except BaseException:
                log.status = STATUS_CLIENT_CLOSED  # cancelled: the client went away
                raise
            finally:
                log.write()
            if last_event is not None:
                yield last_event

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            # Runs even when the client left before the body started: abort for sure.
            background=BackgroundTask(_close, stream),
        )

    async def serve(
        self,
        request: Request,
        log: AccessLog,
        handler: Callable[[AccessLog], Awaitable[Response]],
    ) -> Response:
        """Run ``handler``, writing the access-log line for every outcome but a stream's.

        A client that left (before its body was in, or before its answer was ready) is
        one line with status 499, or 408 when the server cut its body off; no traceback.
        """
        try:
            response = await handler(log)
        except ApiError as exc:
            log.status = exc.status_code
            log.write()
            raise
        except ClientDisconnected:
            timed_out = request.scope.get(BODY_TIMEOUT_SCOPE_KEY, False)
            log.status = STATUS_BODY_TIMEOUT if timed_out else STATUS_CLIENT_CLOSED
            log.write()
            return Response(status_code=log.status)  # to nobody: the connection is gone
        except Exception:
            log.status = 500
            log.write()
            raise
        if not isinstance(response, StreamingResponse):
            log.write()  # a stream writes its line when it ends
        return response

    def _error(self, exc: BaseException, log: AccessLog) -> ApiError:
        return engine_error(exc, log.request_id, self.config.retry_after_seconds)


async def _close(stream: RequestStream) -> None:
    stream.close()


async def _wait_for_disconnect(request: Request) -> None:
    # The body is read, so the next ASGI message is the disconnect, whenever it comes.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")


def _renamed(exc: InvalidParameterError, renames: Mapping[str, str]) -> ApiError:
    param = renames.get(exc.param, exc.param)
    return ApiError.invalid(param, f"{param}: {exc.message}")
