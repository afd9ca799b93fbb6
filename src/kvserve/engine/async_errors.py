"""What can go wrong for a caller of :class:`~kvserve.engine.async_engine.AsyncEngine`.

A failure inside the engine is logged with its details under an error id;
the exception a caller gets holds the id and a message that is safe to show
a client, never the underlying exception's text.
"""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """Too many sequences are waiting; try again later (HTTP 503)."""


class _EngineError(RuntimeError):
    """An engine failure whose details were logged under ``error_id`` (None: nothing logged)."""

    def __init__(self, message: str, error_id: str | None = None) -> None:
        super().__init__(message if error_id is None else f"{message} (error id {error_id})")
        self.message = message
        self.error_id = error_id

    def fresh(self) -> _EngineError:
        """The same error as a new object: raising one object twice would grow its traceback."""
        return type(self)(self.message, self.error_id)


class EngineDeadError(_EngineError):
    """The loop thread is not running (not started, shut down, or broken)."""


class RequestFailedError(_EngineError):
    """The engine failed while computing this request (a whole step, or the request alone)."""
