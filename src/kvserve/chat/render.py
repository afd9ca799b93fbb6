"""A conversation to text through the chat template, under limits; and the check at load.

The template comes with the model, and the project treats model files as
hostile, so it is rendered by :mod:`kvserve.chat.bounded_jinja` (work, size and
time limits), never by transformers' ``apply_chat_template``, whose sandbox
bounds one ``range`` and nothing else. The text is the same: the same
variables (the messages without None-valued keys, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's special tokens), the same
globals and filters.

Whatever goes wrong while rendering becomes a :class:`ChatTemplateError`:
a 400 naming the chat template in the server, ``error: ...`` and exit status
2 on the command line. :func:`check_chat_template` renders sample
conversations once, at load, so that a template that goes past its limits
on an ordinary conversation is refused before the model serves anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from kvserve.chat.bounded_jinja import (
    LIMITS_ENV,
    TemplateLimitError,
    TemplateLimits,
    limits_from_env,
    render_template,
)
from kvserve.errors import ChatTemplateError

# Names a message's reasoning goes by; transformers copies it to all of them,
# since templates read one or another.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_SAMPLE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    }
]
_SYSTEM: dict[str, Any] = {"role": "system", "content": "You are a helpful assistant."}
_ASK: dict[str, Any] = {"role": "user", "content": "What is the capital of France?"}
_ANSWER: dict[str, Any] = {"role": "assistant", "content": "Paris."}
_FOLLOW_UP: dict[str, Any] = {"role": "user", "content": "And of Italy?"}
_CALL: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    ],
}
_RESULT: dict[str, Any] = {
    "role": "tool",
    "content": '{"temperature": 21}',
    "tool_call_id": "call_0",
}
# What the load check renders: the usual shape first, then shapes for templates
# that refuse a system message or an assistant turn; with tools, a call too.
_SAMPLES: tuple[list[dict[str, Any]], ...] = (
    [_SYSTEM, _ASK, _ANSWER, _FOLLOW_UP],
    [_ASK, _ANSWER, _FOLLOW_UP],
    [_ASK],
)
_TOOL_SAMPLES: tuple[list[dict[str, Any]], ...] = ([_SYSTEM, _ASK, _CALL, _RESULT], [_ASK])


def render_chat(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    limits: TemplateLimits | None = None,
) -> str:
    """The conversation's text, through ``chat_template`` or the tokenizer's own.

    ``limits`` default to :func:`~kvserve.chat.bounded_jinja.limits_from_env`.
    Raises :class:`ChatTemplateError` whatever the template does wrong.
    """
    limits = limits or limits_from_env()
    source = _template_source(tokenizer, chat_template, tools)
    variables = {
        **tokenizer.special_tokens_map,
        "messages": [_as_template_sees_it(message) for message in conversation],
        "tools": None if tools is None else list(tools),
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return render_template(source, variables, limits)
    except TemplateLimitError as exc:
        raise ChatTemplateError(
            f"the chat template went past its limits: {exc} ({LIMITS_ENV} sets them)",
            limit=exc.limit,
        ) from None
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(
            f"the chat template did what its sandbox forbids: {exc}", forbidden=True
        ) from None
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {exc}") from None
    except jinja2.TemplateError as exc:  # raise_exception(...), an undefined value
        raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
    except Exception as exc:  # the template's own failure: TypeError, OverflowError, ...
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None


def check_chat_template(
    tokenizer: Any, chat_template: str | None = None, limits: TemplateLimits | None = None
) -> None:
    """Raise :class:`ChatTemplateError` if the template goes past its limits on an
    ordinary conversation (with tools too, if it takes them), or out of its sandbox.

    A template that refuses some sample (roles it does not support) is not
    refused for that: it fails the same way per request, with a 400.
    """
    template = chat_template or tokenizer.chat_template
    if not template:
        return
    samples: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]
    samples = [(conversation, None) for conversation in _SAMPLES]
    if "tools" in str(template):
        samples += [(conversation, _SAMPLE_TOOLS) for conversation in _TOOL_SAMPLES]
    for conversation, tools in samples:
        try:
            render_chat(tokenizer, conversation, True, chat_template, tools, limits)
        except ChatTemplateError as exc:
            if exc.hostile:
                raise
            continue


def install_chat_template(tokenizer: Any, template: str) -> None:
    """Make ``template`` the tokenizer's chat template, once it passes the load check."""
    check_chat_template(tokenizer, template)
    tokenizer.chat_template = template


def _template_source(
    tokenizer: Any, chat_template: str | None, tools: Sequence[Mapping[str, Any]] | None
) -> str:
    """The template's text; of a tokenizer with named templates, the one for tools or the default."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(template, Mapping):
        name = "tool_use" if tools is not None and "tool_use" in template else "default"
        if name not in template:
            raise ChatTemplateError(
                f"the model has several chat templates ({', '.join(sorted(template))}) "
                "and none named 'default'"
            )
        template = template[name]
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("the model has no chat template")
    return template


def _as_template_sees_it(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message as transformers gives it to templates: no None-valued keys
    (templates test for a missing key, not for None), reasoning under each of its names."""
    entry = {key: value for key, value in message.items() if value is not None}
    reasoning = next((entry[key] for key in _REASONING_FIELDS if key in entry), None)
    if reasoning is not None:
        entry = {"thinking": reasoning, **entry, "reasoning_content": reasoning}
    return entry
