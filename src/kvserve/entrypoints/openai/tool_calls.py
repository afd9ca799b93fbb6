"""Tools in a chat request: checking them, the prompt, and forced calls as constrained output.

``tool_choice``: ``none`` (tools are shown, no call is parsed), ``auto`` (the
default with tools: the answer is free text, parsed for calls by a
:mod:`tool_parsers` parser), ``required`` (the answer is constrained to a JSON
list of one to :data:`MAX_PARALLEL_CALLS` calls of the offered functions, one
when ``parallel_tool_calls`` is false) or a named function (the answer is
constrained to that function's arguments schema). ``auto`` and ``none`` answers
are not constrained. A function with ``strict: true`` has its arguments held
to OpenAI's strict meaning (no properties beyond those listed, all of them
present) when a call to it is forced.

Tools reach the model through its chat template's ``tools`` variable. A
template without one (SmolLM2's) gets them in a Hermes-style system prompt
instead, and earlier calls and tool results are written as ``<tool_call>``
text and ``tool`` messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from kvserve.entrypoints.openai.protocol_tools import ChatTool, ToolCall
from kvserve.entrypoints.openai.tool_parsers import (
    CLOSE,
    OPEN,
    TOOL_PARSERS,
    call_from_json,
    new_tool_call,
)
from kvserve.errors import InvalidParameterError
from kvserve.json_limits import JsonTooDeepError, loads_bounded
from kvserve.structured import StructuredOutputsParams
from kvserve.structured.schemas import nest_schema, strict_schema
from kvserve.structured_params import schema_dict

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8
# Compile errors of a forced call's schema name the tools the schema came from.
TOOL_RENAMES = {"structured_outputs.json": "tools", "structured_outputs": "tools"}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolMode:
    """How a request uses its tools: ``none``, ``auto``, ``required`` or ``named``."""

    kind: str
    tools: tuple[ChatTool, ...]
    name: str | None = None  # the function a ``named`` choice forces

    @property
    def names(self) -> set[str]:
        return {tool.function.name for tool in self.tools}

    @property
    def forced(self) -> bool:
        return self.kind in ("required", "named")


def tool_mode(body: ChatCompletionRequest) -> ToolMode | None:
    """The request's tool mode (None without tools); 400 for an inconsistent request."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError.invalid("tool_choice", "tool_choice needs tools.")
        return None
    if len(tools) > MAX_TOOLS:
        raise ApiError.invalid("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}.")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ApiError.invalid("tools", "tool function names must be unique.")
    if choice is None or isinstance(choice, str):
        mode = ToolMode(choice or "auto", tools)
    else:
        if choice.function.name not in names:
            raise ApiError.invalid(
                "tool_choice.function.name",
                f"tool_choice names '{choice.function.name}', which is not among the tools "
                f"({', '.join(names)}).",
            )
        mode = ToolMode("named", tools, choice.function.name)
    if mode.forced and (body.response_format is not None or body.structured_outputs is not None):
        raise ApiError.invalid(
            "tool_choice", "A forced tool call cannot be combined with a response format."
        )
    return mode


def forced_call_constraint(mode: ToolMode, parallel: bool | None) -> StructuredOutputsParams:
    """The JSON schema a ``required`` or ``named`` answer is constrained to.

    A ``named`` answer is the function's arguments: its schema as it is. A
    ``required`` answer is a list of calls, one schema for all the functions:
    each function's schema goes under the wrapper's ``$defs``, its own ``$ref``s
    rewritten to resolve there (see :func:`~kvserve.structured.schemas.nest_schema`).
    A function with ``strict: true`` gets OpenAI's strict meaning
    (:func:`~kvserve.structured.schemas.strict_schema`).
    """
    try:
        if mode.kind == "named":
            (tool,) = (tool for tool in mode.tools if tool.function.name == mode.name)
            return StructuredOutputsParams(json=_arguments_schema(tool))
        by_name = {tool.function.name: _arguments_schema(tool) for tool in mode.tools}
        defs: dict[str, Any] = {}
        calls = []
        for name, schema in by_name.items():
            defs[f"tool_{name}"], arguments = nest_schema(schema, f"tool_{name}")
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema = {
            "$defs": defs,
            "type": "array",
            "items": {"anyOf": calls},
            "minItems": 1,
            "maxItems": 1 if parallel is False else MAX_PARALLEL_CALLS,
        }
        return StructuredOutputsParams(json=schema)
    except InvalidParameterError as exc:
        raise ApiError.invalid("tools", f"tools: {exc.message}") from None


def _arguments_schema(tool: ChatTool) -> dict[str, Any]:
    """A function's arguments schema (checked; strict when the function says so)."""
    if tool.function.parameters is None:
        return _NO_ARGUMENTS
    schema = schema_dict(tool.function.parameters)
    return strict_schema(schema) if tool.function.strict else schema


def forced_calls(mode: ToolMode, text: str) -> list[ToolCall]:
    """The calls of a complete constrained answer (empty if it was cut short)."""
    if mode.kind == "named":
        assert mode.name is not None
        try:
            arguments = loads_bounded(text)
        except ValueError:
            return []
        return [new_tool_call(mode.name, json.dumps(arguments))]
    try:
        values = loads_bounded(text)
    except ValueError:
        return []
    calls = [call_from_json(json.dumps(value), mode.names) for value in values]
    return [call for call in calls if call is not None]


def parse_auto(
    text: str, mode: ToolMode, parser: str = "hermes"
) -> tuple[str | None, list[ToolCall]]:
    return TOOL_PARSERS[parser](text, mode.names)


def conversation(
    messages: list[ChatMessage], mode: ToolMode | None, template_has_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages as the template takes them, and the ``tools`` to pass it (if it takes them)."""
    rendered = []
    for index, message in enumerate(messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise ApiError.invalid(f"messages[{index}].content", "content is required.")
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": content or "",
        }
        if message.tool_calls:
            calls = [
                _template_call(call.function.name, call.function.arguments, index)
                for call in message.tool_calls
            ]
            if template_has_tools:
                entry["tool_calls"] = [{"type": "function", "function": call} for call in calls]
            else:
                blocks = "\n".join(f"{OPEN}\n{json.dumps(call)}\n{CLOSE}" for call in calls)
                entry["content"] = f"{entry['content']}\n{blocks}".strip()
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    if mode is None:
        return rendered, None
    tools = [tool.model_dump(exclude_none=True) for tool in mode.tools]
    if template_has_tools:
        return rendered, tools
    prompt = _hermes_system_prompt(tools)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _template_call(name: str, arguments: str, index: int) -> dict[str, Any]:
    try:
        parsed = loads_bounded(arguments)
    except JsonTooDeepError as exc:
        raise ApiError.invalid(
            f"messages[{index}].tool_calls", f"a tool call's arguments are refused: {exc}."
        ) from None
    except ValueError:
        raise ApiError.invalid(
            f"messages[{index}].tool_calls", "a tool call's arguments must be JSON text."
        ) from None
    return {"name": name, "arguments": parsed}


def _hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(tool) for tool in tools)
    return (
        "You can call functions. Their signatures, one JSON object a line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call one, answer with a JSON object giving its name and arguments inside tags:\n"
        f'{OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CLOSE}'
    )
