"""The engine: request bookkeeping, the step loop, detokenization."""

from __future__ import annotations

from kvserve.engine.llm_engine import LLMEngine, PromptType

__all__ = ["LLMEngine", "PromptType"]
