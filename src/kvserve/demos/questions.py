"""The chat questions the batching demos ask, chosen by how long SmolLM2-135M-Instruct
answers them (greedy, EOS honoured, at most 256 tokens): a few tokens, a few
dozen, or more than 256 (cut at the limit)."""

from __future__ import annotations

SHORT = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the boiling point of water in Celsius?",
    "What is the chemical symbol for gold?",
)
LONG = (
    "Write a detailed essay about the history of the Roman Empire.",
    "Explain in detail how a car engine works.",
    "Write a long story about a dragon who learns to cook.",
    "Describe the water cycle step by step, in detail.",
)
MEDIUM = "How many days are there in a leap year?"


def short_label(question: str, width: int = 28) -> str:
    """The question cut to ``width`` characters, for plot labels."""
    return question if len(question) <= width else question[: width - 1].rstrip() + "…"
