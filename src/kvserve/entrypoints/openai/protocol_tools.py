"""OpenAI's tool-calling shapes: the tools a request offers, the calls an answer makes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# OpenAI's rule for function names.
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class _StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class FunctionDefinition(_StrictModel):
    name: FunctionName
    description: str | None = None
    # A JSON schema of the arguments; none means the function takes no arguments.
    parameters: dict[str, Any] | None = None
    # A forced call (tool_choice required or named) is always constrained to the schema;
    # strict: true also closes its objects and requires all their properties, as OpenAI's
    # strict mode does (kvserve.structured.schemas.strict_schema).
    strict: bool | None = None


class ChatTool(_StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_StrictModel):
    name: FunctionName


class NamedToolChoice(_StrictModel):
    """``tool_choice`` naming the one function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallIn(_StrictModel):
    """A tool call of an earlier assistant message, sent back in ``messages``."""

    id: str
    type: Literal["function"]
    function: FunctionCallIn


class FunctionCallIn(_StrictModel):
    name: str
    arguments: str


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call; ``index`` says which call it belongs to."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall = Field(default_factory=DeltaFunctionCall)


ToolCallIn.model_rebuild()
