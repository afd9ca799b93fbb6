"""What can go wrong for a caller of :class:`~kvserve.engine.async_engine.AsyncEngine`."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """Too many sequences are waiting; try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The loop thread is not running (not started, shut down, or broken)."""


class RequestFailedError(RuntimeError):
    """A step failed while computing this request."""
