"""Errors kvserve raises for bad input, and the ids that tie internal errors to the log.

Every check on user input raises :class:`InvalidParameterError` (a ``ValueError``)
naming the parameter, so callers such as the HTTP server can report *which*
field was wrong without parsing the message. An internal failure is logged
with its details under a :func:`new_error_id`; a client is shown only the id.
"""

from __future__ import annotations

import uuid


class InvalidParameterError(ValueError):
    """A user-supplied value is out of range or of the wrong kind.

    ``param`` is the parameter's name as the user wrote it (``"top_p"``,
    ``"prompt"``, ``"model"``); the message says what is allowed.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


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


def new_error_id() -> str:
    """A random id for one internal failure: clients see it, the log record with details has it."""
    return uuid.uuid4().hex
