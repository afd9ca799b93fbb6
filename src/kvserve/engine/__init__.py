"""The engine: request bookkeeping, the step loop, detokenization, and its async wrapper."""

from __future__ import annotations

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import LLMEngine, PromptType

__all__ = ["AsyncEngine", "LLMEngine", "PromptType"]
