"""OpenAI API request and response bodies (pydantic v2).

Requests are parsed strictly: a JSON string is not a number, ``true`` is not
an integer, NaN and infinities are refused, and an unknown field is an error
naming it (OpenAI answers "Unrecognized request argument supplied", and a
silently ignored typo such as ``max_token`` would be worse). Sampling fields
may be null, meaning the default. Ranges are checked by ``SamplingParams``,
so the limits live in one place. vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ...) are accepted
under vLLM's names, which is how the ``openai`` client's ``extra_body`` sends them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    model_serializer,
)

from kvserve.entrypoints.openai.protocol_tools import (
    ChatTool,
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
    ToolCallIn,
)

# The longest cache_salt: it is hashed into every KV block of the request.
MAX_CACHE_SALT_LENGTH = 256


class _StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(_StrictModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: the field has another name in Python.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # The schema is always enforced; strict: true also closes its objects and requires all
    # their properties, as OpenAI's strict mode does (kvserve.structured.schemas.strict_schema).
    strict: bool | None = None


class ResponseFormat(_StrictModel):
    """``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_StrictModel):
    """vLLM's ``structured_outputs`` field: exactly one of these constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # OpenAI's end-user id, for abuse tracking upstream: accepted, unused.
    user: str | None = None
    # Accepted only when empty: kvserve has no logit bias.
    logit_bias: dict[str, float] | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # The logprob of every prompt token after the first, and this many alternatives.
    prompt_logprobs: int | None = None
    # Only requests with the same salt share prefix-cache blocks.
    cache_salt: (
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_CACHE_SALT_LENGTH)] | None
    ) = None
    # Constrained output: OpenAI's response_format, or vLLM's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one prompt or a batch of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = None
    logprobs: int | None = None
    # Accepted only when they change nothing: kvserve does not support them.
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(_StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(_StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required, except in an assistant message that made tool calls.
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: a conversation rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


# ---------------------------------------------------------------- responses


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one token's entry in ``prompt_logprobs``."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per prompt token: null for the first, then {token id (as a string): entry}.
PromptLogprobsBody = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM extension: the stop string or stop token id that ended the choice.
    stop_reason: int | str | None = None
    # vLLM extension, with the request's prompt_logprobs: its prompt's (in the first chunk).
    prompt_logprobs: PromptLogprobsBody | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (``object="text_completion"`` too) one streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # vLLM extension, with the request's prompt_logprobs.
    prompt_logprobs: PromptLogprobsBody | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # OpenAI's chunks carry only what changed: {"content": "..."}, or {} at the end.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    # vLLM extension, with the request's prompt_logprobs: in one chunk, once computed.
    prompt_logprobs: PromptLogprobsBody | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_StrictModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    # Default: true for a prompt, false for messages (the template adds its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_StrictModel):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
