"""OpenAI's Responses API bodies (``POST /v1/responses``), as far as kvserve serves them.

Requests are parsed as strictly as the chat endpoint's (``protocol.py``). The
fields OpenAI defines that kvserve does not implement (reasoning, background
runs, conversations, prompt templates, ...) are declared here only so that a
request using them gets a 400 saying the field is not supported, rather than
"unrecognized" (see ``responses_request.py``). Input items and tools are kept
as raw objects here and checked one by one there: their ``type`` decides the
shape, and a built-in tool or an image deserves a message of its own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from kvserve.entrypoints.openai.protocol_tools import FunctionName

# OpenAI's limits on a format's name and on metadata.
FormatName = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MAX_METADATA_ENTRIES = 16
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class _StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextFormat(_StrictModel):
    """``text.format``: plain text, any JSON object, or JSON matching a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: FormatName | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: the field has another name in Python.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_StrictModel):
    format: TextFormat | None = None
    # Only OpenAI's default: kvserve has no way to make a model more or less wordy.
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(_StrictModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = None
    # End-user ids, for abuse tracking upstream: accepted and echoed, unused.
    user: str | None = None
    safety_identifier: str | None = None
    # OpenAI's, not implemented: refused unless absent or meaning "off" (UNSUPPORTED_FIELDS).
    background: Any = None
    background_options: Any = None
    context_management: Any = None
    conversation: Any = None
    include: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    prompt: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning: Any = None
    service_tier: Any = None
    stream_options: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    image: Any = None
    access_programs: Any = None


# Fields kvserve does not implement, with the values that ask for nothing (besides null).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "background_options": (),
    "context_management": ([],),
    "conversation": (),
    "include": ([],),
    "max_tool_calls": (),
    "moderation": (),
    "prompt": (),
    "prompt_cache_key": (),
    "prompt_cache_options": (),
    "prompt_cache_retention": (),
    "reasoning": (),
    "service_tier": ("auto", "default"),
    "stream_options": (),
    "top_logprobs": (0,),
    "truncation": ("disabled",),
    "image": (),
    "access_programs": (),
}


# ------------------------------------------------------------ input items


class InputTextPart(_StrictModel):
    """A text content part: the client's (``input_text``) or an earlier answer's (``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str
    # What an earlier answer's part carries when sent back as it came; kvserve writes
    # neither (no annotations, no logprobs), so they hold nothing to read.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_StrictModel):
    """A call an earlier answer made, sent back so the tool's result can follow it."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_StrictModel):
    """A tool's result for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionTool(_StrictModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_StrictModel):
    """``tool_choice`` naming the one function the answer must call."""

    type: Literal["function"]
    name: FunctionName


# --------------------------------------------------------------- output


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    # Prompt tokens found in the prefix cache are not counted per request: always 0.
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response, whole (``POST``, ``GET``) or as a stream's events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response (its other fields depend on ``type``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
