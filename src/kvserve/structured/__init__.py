"""Structured outputs: a request's text constrained to a JSON schema, regex, choice or grammar.

:class:`StructuredOutputsParams` (in ``SamplingParams.structured_outputs``) says
what the output must match; :class:`GrammarCompiler` compiles it once per
distinct spec on worker threads; each sequence keeps a :class:`GrammarState`
whose token bitmask is applied to its logits row before sampling
(:func:`kvserve.sample.grammar_mask.apply_token_bitmask`).

The spec is plain data that ``SamplingParams`` carries, so it lives beside it
(``kvserve/structured_params.py``, the base floor); it is re-exported here with
the compiler that takes it.
"""

from __future__ import annotations

from kvserve.structured.compiler import COMPILE_TIMEOUT_S, CompiledGrammar, GrammarCompiler
from kvserve.structured.state import GrammarState
from kvserve.structured_params import GrammarSpec, StructuredOutputsParams

__all__ = [
    "COMPILE_TIMEOUT_S",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarSpec",
    "GrammarState",
    "StructuredOutputsParams",
]
