"""A Responses request as the chat endpoint's request, and the chat path's errors renamed back.

``/v1/responses`` has no generation logic of its own: its request becomes a
:class:`ChatCompletionRequest` (``instructions`` a system message first, then
the stored conversation of ``previous_response_id``, then the ``input`` items;
flat function tools wrapped as chat tools; ``text.format`` as
``response_format``; ``max_output_tokens`` as ``max_completion_tokens``), and
the chat path checks, renders, constrains and samples it. Its errors name the
chat fields, so :func:`renamed` maps them to the fields this client sent.

Input items: ``message`` (text, or text parts), ``function_call`` (a call an
earlier answer made: it joins the assistant message before it, as chat's
``tool_calls`` do) and ``function_call_output`` (a ``tool`` message). Anything
else (images, files, reasoning items, item references) is refused, naming it.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from kvserve.entrypoints.openai.protocol_responses import (
    MAX_METADATA_ENTRIES,
    UNSUPPORTED_FIELDS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    FunctionToolChoice,
    InputTextPart,
    MessageItem,
    ResponsesRequest,
)
from kvserve.entrypoints.openai.protocol_tools import FunctionCallIn, ToolCallIn

ModelT = TypeVar("ModelT", bound=BaseModel)

_TEXT_PARTS = ("input_text", "output_text")
_ITEM_TYPES = "'message', 'function_call' and 'function_call_output'"
# Chat field names in the chat path's errors -> the Responses fields they came from.
# Parameters are renamed whole; messages only where they spell a path.
_PARAM_RENAMES = (
    (re.compile(r"response_format\.json_schema\.(schema|name)"), r"text.format.\1"),
    (re.compile(r"response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"messages(\[\d+\])?(\.[a-z_]+)*"), "input"),
)
_MESSAGE_RENAMES = (*_PARAM_RENAMES[:4], (re.compile(r"messages\[\d+\](\.[a-z_]+)*"), "input"))


def check_supported(body: ResponsesRequest) -> None:
    """400 naming the first field kvserve does not implement that asks for something.

    Also holds ``metadata`` to OpenAI's limit: it is stored with the response.
    """
    if body.metadata is not None and len(body.metadata) > MAX_METADATA_ENTRIES:
        raise ApiError.invalid(
            "metadata",
            f"at most {MAX_METADATA_ENTRIES} metadata entries, got {len(body.metadata)}.",
        )
    for name, harmless in UNSUPPORTED_FIELDS.items():
        value = getattr(body, name)
        if value is not None and not any(
            value == ok and type(value) is type(ok) for ok in harmless
        ):
            raise ApiError.invalid(
                name, f"'{name}' is not supported by kvserve's /v1/responses; omit it."
            )


def chat_request(body: ResponsesRequest, history: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that computes this response.

    history: the conversation of ``previous_response_id`` (its inputs and answers).
    """
    messages = [*history, *input_messages(body.input)]
    if body.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=body.instructions))
    tools = [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in function_tools(body.tools)
    ]
    choice: Any = tool_choice(body.tool_choice)
    if isinstance(choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "stream": body.stream,
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(ApiError.from_validation(exc.errors())) from None


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """``input`` as chat messages: a string is one user message."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    messages: list[ChatMessage] = []
    for index, raw in enumerate(value):
        kind = raw.get("type", "message")
        where = ("input", index)
        if kind == "message":
            _check_parts(raw.get("content"), f"input[{index}].content")
            item = _validate(MessageItem, raw, where)
            messages.append(ChatMessage(role=item.role, content=_text(item.content)))
        elif kind == "function_call":
            call = _validate(FunctionCallItem, raw, where)
            tool_call = ToolCallIn(
                id=call.call_id,
                type="function",
                function=FunctionCallIn(name=call.name, arguments=call.arguments),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                calls = [*(last.tool_calls or []), tool_call]
                messages[-1] = last.model_copy(update={"tool_calls": calls})
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[tool_call]))
        elif kind == "function_call_output":
            _check_parts(raw.get("output"), f"input[{index}].output")
            result = _validate(FunctionCallOutputItem, raw, where)
            messages.append(
                ChatMessage(role="tool", content=_text(result.output), tool_call_id=result.call_id)
            )
        else:
            raise ApiError.invalid(
                f"input[{index}].type",
                f"Input items of type '{kind}' are not supported; kvserve takes {_ITEM_TYPES}.",
            )
    if not messages:
        raise ApiError.invalid("input", "input must hold at least one item.")
    return messages


def function_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """The request's tools; 400 for a built-in tool (web search, file search, ...)."""
    checked = []
    for index, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise ApiError.invalid(
                f"tools[{index}].type",
                f"Tools of type '{kind}' are not supported: kvserve has no built-in tools, "
                "only 'function' tools.",
            )
        checked.append(_validate(FunctionTool, tool, ("tools", index)))
    return checked


def tool_choice(choice: str | dict[str, Any] | None) -> str | FunctionToolChoice | None:
    """``none``, ``auto``, ``required`` or one named function."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise ApiError.invalid(
            "tool_choice.type",
            f"tool_choice of type '{choice.get('type')}' is not supported; use 'none', 'auto', "
            "'required' or {'type': 'function', 'name': ...}.",
        )
    return _validate(FunctionToolChoice, choice, ("tool_choice",))


def renamed(error: ApiError) -> ApiError:
    """``error`` from the chat path, naming the Responses fields instead of chat's."""
    param, message = error.param, error.message
    if param is not None:
        for pattern, name in _PARAM_RENAMES:
            param = pattern.sub(name, param)
    for pattern, name in _MESSAGE_RENAMES:
        message = pattern.sub(name, message)
    return ApiError(error.status_code, message, param=param, code=error.code, headers=error.headers)


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    form = body.text.format if body.text is not None else None
    if form is None:
        return None
    if form.type != "json_schema":
        for name, value in (("name", form.name), ("schema", form.json_schema)):
            if value is not None:
                raise ApiError.invalid(
                    f"text.format.{name}", f"text.format.{name} needs type 'json_schema'."
                )
        return {"type": form.type}
    for name, value in (("name", form.name), ("schema", form.json_schema)):
        if value is None:
            raise ApiError.invalid(
                f"text.format.{name}", f"Missing required parameter: 'text.format.{name}'."
            )
    named: dict[str, Any] = {"name": form.name, "schema": form.json_schema}
    if form.description is not None:
        named["description"] = form.description
    if form.strict is not None:
        named["strict"] = form.strict
    return {"type": "json_schema", "json_schema": named}


def _check_parts(content: Any, where: str) -> None:
    """400 naming a content part that is not text (an image, a file, audio)."""
    if not isinstance(content, list):
        return
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ApiError.invalid(
                f"{where}[{index}].type",
                f"Content parts of type '{kind}' are not supported; kvserve takes text parts "
                "('input_text', 'output_text').",
            )


def _text(content: str | list[InputTextPart]) -> str:
    # Text parts are joined with newlines, as the chat endpoint joins its parts.
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _validate(model: type[ModelT], value: Any, where: tuple[Any, ...]) -> ModelT:
    """``value`` as ``model``; a 400 naming the field by its path in the request."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [{**error, "loc": (*where, *error["loc"])} for error in exc.errors()]
        raise ApiError.from_validation(errors) from None
