"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Everything the server refuses goes through :class:`ApiError`, so every error
body has that shape, whoever raised it: our checks, pydantic, FastAPI's own
validation (its 422 becomes a 400, as OpenAI answers), Starlette's 404/405,
an engine failure or an unexpected exception. A 5xx never shows the client
what went wrong inside, only an error id; the log has the details under it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, HTTPConnection

from kvserve.engine.async_errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    StructuredOutputsBody,
    TextContentPart,
    TokenizeRequest,
)
from kvserve.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    FunctionToolChoice,
    InputTextPart,
    MessageItem,
    ResponsesRequest,
    TextConfig,
    TextFormat,
)
from kvserve.entrypoints.openai.protocol_tools import (
    ChatTool,
    FunctionCallIn,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
)
from kvserve.errors import new_error_id

logger = logging.getLogger(__name__)

JSON_MEDIA_TYPE = "application/json"

# Names that can appear in a pydantic error location; anything else there is a
# union member's tag (such as "list[int]"), which is no part of the parameter's path.
_FIELD_NAMES = frozenset(
    name
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        ChatMessage,
        TextContentPart,
        StreamOptions,
        ResponseFormat,
        JsonSchemaFormat,
        StructuredOutputsBody,
        TokenizeRequest,
        DetokenizeRequest,
        ChatTool,
        FunctionDefinition,
        NamedToolChoice,
        NamedFunction,
        ToolCallIn,
        FunctionCallIn,
        ResponsesRequest,
        TextConfig,
        TextFormat,
        InputTextPart,
        MessageItem,
        FunctionCallItem,
        FunctionCallOutputItem,
        FunctionTool,
        FunctionToolChoice,
    )
    for field_name, info in model.model_fields.items()
    for name in (field_name, info.alias or field_name)
)


class ApiError(Exception):
    """An HTTP error with an OpenAI error body; ``param`` names the offending field."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return "server_error" if self.status_code >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)

    @classmethod
    def invalid(cls, param: str | None, message: str, code: str | None = None) -> ApiError:
        """A 400 for a bad value of ``param``."""
        return cls(400, message, param=param, code=code)

    @classmethod
    def internal(
        cls,
        error_id: str,
        status_code: int = 500,
        what: str = "The server had an error while processing the request",
        code: str | None = None,
    ) -> ApiError:
        """A 5xx that tells the client only ``what`` and the id the log has the details under."""
        return cls(status_code, f"{what} (error id {error_id}).", code=code)

    @classmethod
    def from_validation(cls, errors: Sequence[Any]) -> ApiError:
        """A 400 describing the first of pydantic's errors."""
        if not errors:
            return cls.invalid(None, "The request body is invalid.")
        locs = [_strip_body(tuple(error["loc"])) for error in errors]
        kind, loc, message = errors[0]["type"], locs[0], errors[0]["msg"]
        if kind == "json_invalid":
            return cls.invalid(None, f"The request body is not valid JSON: {message}.")
        if not loc:
            return cls.invalid(None, "The request body must be a JSON object.")
        if kind == "extra_forbidden":
            param = _param_path(loc)
            return cls.invalid(param, f"Unrecognized request argument supplied: {param}.")
        tag_at = next((i for i, item in enumerate(loc) if _is_union_tag(item)), None)
        if tag_at is not None:
            prefix = loc[:tag_at]
            tags = dict.fromkeys(
                str(o[tag_at]) for o in locs if o[:tag_at] == prefix and o[tag_at:]
            )
            if len(tags) > 1:
                # A union (prompt, stop, content): name the shapes it accepts.
                param = _param_path(prefix)
                expected = " or ".join(tags)
                return cls.invalid(param, f"Invalid type for '{param}': expected {expected}.")
        param = _param_path(loc)
        if kind == "missing":
            return cls.invalid(param, f"Missing required parameter: '{param}'.")
        return cls.invalid(param, f"Invalid value for '{param}': {message}.")


def require_json_body(request: HTTPConnection) -> None:
    """415 unless the request says its body is JSON (``application/json``, any parameters).

    The one rule for every route that takes a body (the API's and the dashboard's
    load button). A page in a browser may POST to any address without asking first
    only with a ``text/plain``, form or untyped body (a "simple" request); a JSON
    content type makes the browser ask the server with a CORS preflight, which this
    server never grants. So no web page can make a keyless local server generate.
    """
    content_type = request.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        got = f"'{content_type[:100]}'" if content_type else "none"
        raise ApiError(
            415,
            f"Send the request body as JSON, with 'Content-Type: {JSON_MEDIA_TYPE}' (got {got}).",
            code="unsupported_media_type",
        )


def _strip_body(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    # FastAPI's own validation prefixes a field with where it came from.
    return loc[1:] if loc[:1] in (("body",), ("query",), ("path",), ("header",)) else loc


def _is_union_tag(item: object) -> bool:
    """pydantic puts a union member's name ("list[int]") in its errors' locations.

    So do dict keys; ``from_validation`` tells them apart by counting alternatives.
    """
    return isinstance(item, str) and item not in _FIELD_NAMES


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """pydantic's location as a parameter path: ``messages[0].content``."""
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        else:
            path += f".{item}" if path else str(item)
    return path or None


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns an OpenAI error body."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, (RequestValidationError, ValidationError))
        return ApiError.from_validation(exc.errors()).response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
        return error.response()

    async def on_unexpected_error(request: Request, exc: Exception) -> Response:
        error_id = new_error_id()
        logger.error(
            "error %s: unhandled error serving %s", error_id, request.url.path, exc_info=exc
        )
        return ApiError.internal(error_id).response()

    async def on_client_disconnect(request: Request, exc: Exception) -> Response:
        # A client that left while its body was read is no server error: one line, no
        # traceback (the API routes log theirs in the access log; this is for any other).
        logger.info(
            "%s %s status=499: the client left before its body was in",
            request.method,
            request.url.path,
        )
        return Response(status_code=499)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(ClientDisconnect, on_client_disconnect)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)


def engine_error(exc: BaseException, request_id: str, retry_after_seconds: int) -> ApiError:
    """The HTTP error for an exception raised while serving ``request_id``.

    An engine failure was logged where it happened, under the error id it carries;
    anything else is logged here, under a new id.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return ApiError(
            503,
            f"The server is overloaded ({exc}); retry later.",
            code="overloaded",
            headers={"Retry-After": str(retry_after_seconds)},
        )
    error_id = exc.error_id if isinstance(exc, (EngineDeadError, RequestFailedError)) else None
    if error_id is None:
        error_id = new_error_id()
        if isinstance(exc, EngineDeadError):  # not started or shut down: no traceback to keep
            logger.warning("error %s: serving %s: %s", error_id, request_id, exc)
        else:
            logger.error("error %s: serving %s failed", error_id, request_id, exc_info=exc)
    if isinstance(exc, EngineDeadError):
        return ApiError.internal(
            error_id, 503, "The engine is not running", code="engine_unavailable"
        )
    code = "generation_failed" if isinstance(exc, RequestFailedError) else None
    return ApiError.internal(error_id, code=code)
