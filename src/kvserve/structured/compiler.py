"""Compile grammar specs into llguidance matchers, off the step loop, once per spec.

The grammar engine is llguidance (chosen over xgrammar: no dependencies at all,
where xgrammar's wheel declares triton, useless on CPU and hundreds of MB;
~1 ms to compile the schemas we tried; ~8 us per row per step to compute a
mask, small beside a decode step; per-step work bounded by its lexer fuel).

A compiled grammar is a matcher that never consumes a token (the template);
each sequence gets a deep copy. Templates are kept in a bounded LRU cache
keyed by the canonical spec, as futures: a second request for a spec still
compiling waits on the same future. Compiles run on a small thread pool
(llguidance drops the GIL while it builds a grammar), so the caller chooses
whether to wait (the server does, before queuing, to answer 400 on a bad
spec) or not (the engine keeps a request out of the scheduler until its
future is done, so no step waits for a compile).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidParameterError
from kvserve.structured.params import PARAM, GrammarSpec

# A compile that takes longer is refused (the server stops waiting for it).
COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
_NUM_WORKERS = 2
# Characters the regex syntax (Rust's regex crate) gives a meaning; a choice escapes them.
_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")


@dataclass
class CompileStats:
    """Cache hits and misses, and the seconds each compile took (most recent last)."""

    hits: int = 0
    misses: int = 0
    compile_seconds: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class CompiledGrammar:
    """A compiled spec; :meth:`new_matcher` gives each sequence its own state."""

    def __init__(self, template: Any, num_tokens: int) -> None:
        self._template = template  # llguidance.LLMatcher at its start state, never advanced
        # Tokens the bitmask covers (the model's vocabulary, or the tokenizer's if larger).
        self.num_tokens = num_tokens

    def new_matcher(self) -> Any:
        """A fresh llguidance matcher at the grammar's start."""
        return self._template.deep_copy()


class GrammarCompiler:
    """Turns :class:`GrammarSpec` into :class:`CompiledGrammar`, cached, on worker threads.

    tokenizer: the model's (fast) Hugging Face tokenizer.
    vocab_size: the model's vocabulary (rows of the logits), >= the tokenizer's.
    eos_token_ids: the tokens that end a sequence; the grammar allows them when complete.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None  # built on first use (~0.3 s for a 49k vocabulary)
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_NUM_WORKERS, thread_name_prefix="kvserve-grammar")
        self.stats = CompileStats()

    def compile(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compiled grammar of ``spec``, as a future (done at once on a cache hit).

        The future raises :class:`InvalidParameterError` when the spec does not compile.
        """
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                return future
            self.stats.misses += 1
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def shutdown(self) -> None:
        """Stop the worker threads (compiles under way finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        tokenizer = self._tokenizer()  # built once, not part of any compile's time
        start = time.perf_counter()
        grammar = _grammar_text(spec)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(
                f"{PARAM}.{spec.kind}", f"does not compile: {matcher.get_error()}"
            )
        with self._lock:
            self.stats.compile_seconds.append(time.perf_counter() - start)
            del self.stats.compile_seconds[: -self._cache_size]
        return CompiledGrammar(matcher, tokenizer.vocab_size)

    def _tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _build_tokenizer(
                    self._hf_tokenizer, self.vocab_size, self._eos_token_ids
                )
            return self._ll_tokenizer


def _build_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise InvalidParameterError(
            PARAM, "needs a fast (Rust) Hugging Face tokenizer; this model's is not one"
        )
    # The logits may have more rows than the tokenizer has tokens (padded
    # embeddings): n_vocab covers them, and they are never allowed.
    n_vocab = max(vocab_size, len(tokenizer))
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)


def _grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for a spec; raises InvalidParameterError for bad GBNF."""
    import json

    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    if spec.kind == "json":
        try:
            return LLMatcher.grammar_from_json_schema(spec.text)
        except ValueError as exc:
            raise InvalidParameterError(f"{PARAM}.json", f"is not a JSON schema: {exc}") from None
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        return LLMatcher.grammar_from_regex("|".join(_REGEX_META.sub(r"\\\1", c) for c in choices))
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(spec.text))
    except (GbnfToLarkError, ValueError) as exc:
        raise InvalidParameterError(f"{PARAM}.grammar", f"does not parse: {exc}") from None
