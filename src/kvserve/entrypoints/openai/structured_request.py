"""The constraint a request's output must meet, from ``response_format`` or ``structured_outputs``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) both become a :class:`StructuredOutputsParams`; a request may
use one of them, not both. Before anything is queued the grammar is compiled
and probed (off the event loop, cached by the engine), so a schema, regex or
grammar that does not compile, compiles for too long, or hits the grammar
engine's limits on its first tokens is a 400 naming the field the client sent.

A ``json_schema`` with ``strict: true`` is held to OpenAI's meaning of strict:
no object has properties beyond those it lists, and each has all of them
(:func:`~kvserve.structured.schemas.strict_schema`). Without ``strict`` the
schema means what JSON Schema says (an object that does not say
``additionalProperties: false`` may have more properties).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve.engine.engine_client import EngineClient
from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol import ResponseFormat, StructuredOutputsBody
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams
from kvserve.structured import COMPILE_TIMEOUT_S, StructuredOutputsParams
from kvserve.structured.schemas import strict_schema
from kvserve.structured_params import schema_dict

# Engine parameter names -> the field a response_format request sent.
RESPONSE_FORMAT_RENAMES = {
    "structured_outputs.json": "response_format.json_schema.schema",
    "structured_outputs": "response_format",
}


def structured_outputs(body: Any) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
    """The request's constraint (None without one), and how to rename its errors' fields."""
    response_format: ResponseFormat | None = body.response_format
    fields: StructuredOutputsBody | None = body.structured_outputs
    if fields is not None and response_format is not None and response_format.type != "text":
        raise ApiError.invalid(
            "structured_outputs", "Use response_format or structured_outputs, not both."
        )
    try:
        if fields is not None:
            values = fields.model_dump(exclude_none=True, by_alias=True)
            return StructuredOutputsParams(**values), {}
        if response_format is None or response_format.type == "text":
            if response_format is not None and response_format.json_schema is not None:
                raise ApiError.invalid(
                    "response_format.json_schema", "json_schema needs type 'json_schema'."
                )
            return None, {}
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True), RESPONSE_FORMAT_RENAMES
        schema = response_format.json_schema
        if schema is None or schema.json_schema is None:
            raise ApiError.invalid(
                "response_format.json_schema.schema",
                "response_format of type 'json_schema' needs json_schema.schema.",
            )
        if schema.strict:
            strict = strict_schema(schema_dict(schema.json_schema))
            return StructuredOutputsParams(json=strict), RESPONSE_FORMAT_RENAMES
        return StructuredOutputsParams(json=schema.json_schema), RESPONSE_FORMAT_RENAMES
    except InvalidParameterError as exc:
        renames = {} if fields is not None else RESPONSE_FORMAT_RENAMES
        param = renames.get(exc.param, exc.param)
        raise ApiError.invalid(param, f"{param}: {exc.message}") from None


async def compile_before_queuing(
    engine: EngineClient, params: SamplingParams, renames: dict[str, str]
) -> None:
    """Wait for the request's grammar (cached by the engine); 400 if it does not compile in time."""
    compiled = engine.compile_grammar(params)
    if compiled is None:
        return
    try:
        # shield: a timeout or a client leaving must not cancel the compile,
        # which the cache shares with every request for the same spec.
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiled)), COMPILE_TIMEOUT_S)
    except InvalidParameterError as exc:
        param = renames.get(exc.param, exc.param)
        raise ApiError.invalid(param, f"{param}: {exc.message}") from None
    except asyncio.TimeoutError:
        param = renames.get("structured_outputs", "structured_outputs")
        raise ApiError.invalid(
            param, f"{param}: the grammar took longer than {COMPILE_TIMEOUT_S:g} s to compile."
        ) from None
