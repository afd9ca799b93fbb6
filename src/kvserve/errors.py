"""Errors kvserve raises for bad input, and the ids that tie internal errors to the log.

Every check on user input raises :class:`InvalidParameterError` (a ``ValueError``)
naming the parameter, so callers such as the HTTP server can report *which*
field was wrong without parsing the message. An internal failure is logged
with its details under a :func:`new_error_id`; a client is shown only the id.
"""

from __future__ import annotations

import uuid
from typing import Any


class InvalidParameterError(ValueError):
    """A user-supplied value is out of range or of the wrong kind.

    ``param`` is the parameter's name as the user wrote it (``"top_p"``,
    ``"prompt"``, ``"model"``); the message says what is allowed.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling would call __init__ with ``args`` (the one formatted message):
        # rebuild from the attributes instead, so the error can cross to another
        # process (a Ray Serve replica refusing a request, serve/ray/).
        return (_rebuild, (type(self), self.args, self.__dict__))


class ModelLoadError(InvalidParameterError):
    """The model could not be resolved or read (unknown alias, missing or corrupt file).

    ``field``, when set, names the part of the model's files at fault: a GGUF
    metadata key or header part, a ``config.json`` key, a tensor name, a shard
    index entry. The message names it too; the attribute is for callers (and
    tests) that sort errors without parsing text.
    """

    def __init__(self, message: str, param: str = "model", *, field: str | None = None) -> None:
        super().__init__(param, message)
        self.field = field


class ChatTemplateError(InvalidParameterError):
    """The chat template cannot render a conversation: it raised, or went past a limit.

    ``limit`` names the limit it went past (``steps``, ``chars``, ``seconds``,
    ``template_chars``: see :mod:`kvserve.chat.bounded_jinja.limits`); ``forbidden``
    is set when the sandbox stopped it reaching what templates may not reach.
    Either way the template, not the conversation, is at fault: a model whose
    template does this on a sample conversation is refused at load. Otherwise
    (``limit`` None, ``forbidden`` False) the template refused this conversation
    or failed on it.
    """

    def __init__(self, message: str, limit: str | None = None, forbidden: bool = False) -> None:
        super().__init__("chat_template", message)
        self.limit = limit
        self.forbidden = forbidden

    @property
    def hostile(self) -> bool:
        """The template went past a limit or out of the sandbox."""
        return self.limit is not None or self.forbidden


def _rebuild(
    cls: type[InvalidParameterError], args: tuple[Any, ...], attributes: dict[str, Any]
) -> InvalidParameterError:
    """An unpickled InvalidParameterError (or subclass), without calling its __init__."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(attributes)
    return error


def new_error_id() -> str:
    """A random id for one internal failure: clients see it, the log record with details has it."""
    return uuid.uuid4().hex
