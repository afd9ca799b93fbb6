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

Some grammars build, yet hit llguidance's limits only once generation starts:
a regex whose lexer runs out of fuel (``a{1000}{1000}``), a rule of more
alternatives than a parser row may hold (3,000 of them, where
``max_items_in_row`` allows 2,000; see :func:`limits`). A compile therefore also probes the
grammar (:func:`probe`): on a copy of the matcher it computes the first
masks and consumes a spread of the allowed tokens, as the first steps of a
request would, and refuses the spec if the matcher errs. Errors are built
without llguidance's verbose state, which quotes the whole grammar; logs name
a spec by its digest and length (:attr:`GrammarSpec.label`), never its text.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import tokenizers

from kvserve.errors import InvalidParameterError
from kvserve.structured_params import PARAM, GrammarSpec

logger = logging.getLogger(__name__)

# A compile that takes longer is refused (the server stops waiting for it).
COMPILE_TIMEOUT_S = 10.0
# The probe: this many steps (mask, then a token) along one path, and at each
# step this many of the allowed tokens consumed (each on its own copy).
PROBE_STEPS = 3
PROBE_TOKENS = 8
# An llguidance error is cut to its first line and at most this many characters.
MAX_ERROR_CHARS = 300
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

    def __init__(self, template: Any, num_tokens: int, label: str = "") -> None:
        self._template = template  # llguidance.LLMatcher at its start state, never advanced
        # Tokens the bitmask covers (the model's vocabulary, or the tokenizer's if larger).
        self.num_tokens = num_tokens
        self.label = label  # the spec's GrammarSpec.label, for errors and logs

    def new_matcher(self) -> Any:
        """A fresh llguidance matcher at the grammar's start."""
        return self._template.deep_copy()


class GrammarCompiler:
    """Turns :class:`GrammarSpec` into :class:`CompiledGrammar`, cached, on worker threads.

    tokenizer: the model's fast tokenizer (transformers' or kvserve's FastTokenizer).
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
        try:
            return self._compile_checked(spec)
        except InvalidParameterError as exc:
            logger.warning("structured outputs: %s refused: %s", spec.label, exc.message)
            raise

    def _compile_checked(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        tokenizer = self._tokenizer()  # built once, not part of any compile's time
        start = time.perf_counter()
        grammar = _grammar_text(spec)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
        if matcher.is_error():
            raise InvalidParameterError(
                f"{PARAM}.{spec.kind}", f"does not compile: {short_error(matcher.get_error())}"
            )
        error = probe(matcher, tokenizer.eos_tokens)
        if error is not None:
            raise InvalidParameterError(
                f"{PARAM}.{spec.kind}",
                f"is beyond the grammar engine's limits (found on its first tokens): {error}",
            )
        with self._lock:
            self.stats.compile_seconds.append(time.perf_counter() - start)
            del self.stats.compile_seconds[: -self._cache_size]
        return CompiledGrammar(matcher, tokenizer.vocab_size, spec.label)

    def _tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _build_tokenizer(
                    self._hf_tokenizer, self.vocab_size, self._eos_token_ids
                )
            return self._ll_tokenizer


def limits() -> Any:
    """llguidance's limits for every matcher: its defaults, less the verbose errors.

    A verbose error carries the parser's state and the whole grammar (up to
    :data:`~kvserve.structured_params.MAX_SPEC_CHARS` characters), which would
    go into 400 answers and error logs.
    """
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def short_error(error: str) -> str:
    """An llguidance error's first line, at most :data:`MAX_ERROR_CHARS` characters."""
    line = error.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def probe(template: Any, eos_token_ids: Sequence[int]) -> str | None:
    """Run a grammar's first steps on a copy of ``template``; the error they hit, or None.

    Each of :data:`PROBE_STEPS` steps computes the mask (the lexer's and the
    parser's work for the step), then consumes up to :data:`PROBE_TOKENS` of
    the allowed tokens, spread over the allowed ids, each on its own copy, and
    goes on along the first, and through any tokens the grammar then forces
    (a JSON key and its colon). Limits that a grammar hits at its first tokens
    (lexer fuel, items in a parser row, lexer states) show up here as the
    matcher's error. A grammar that hits one later still fails at run time.
    """
    import numpy as np

    eos = np.asarray(list(eos_token_ids), dtype=np.int64)
    matcher = template.deep_copy()
    for _ in range(PROBE_STEPS):
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            return short_error(matcher.get_error())
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        allowed = allowed[~np.isin(allowed, eos)]
        if allowed.size == 0:
            return None  # the output is complete (or may only end): nothing more to probe
        picks = np.unique(allowed[np.linspace(0, allowed.size - 1, PROBE_TOKENS).astype(int)])
        for token_id in picks[1:]:
            branch = matcher.deep_copy()
            if not branch.consume_token(int(token_id)):
                return short_error(branch.get_error())
        if not matcher.consume_token(int(picks[0])):
            return short_error(matcher.get_error())
        # Text the grammar forces from here (`"key":` in a JSON object) costs no step.
        forced = matcher.compute_ff_tokens()
        if matcher.is_error() or (forced and not matcher.consume_tokens(forced)):
            return short_error(matcher.get_error())
    return None


def _build_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise InvalidParameterError(
            PARAM, "needs a fast (Rust) Hugging Face tokenizer; this model's is not one"
        )
    # llguidance reads the Rust tokenizer's JSON, added tokens included, without
    # padding and truncation settings: where the tokenizer has any (transformers'
    # may), a copy drops them without touching the shared one. kvserve's
    # FastTokenizer has none, and its JSON (33 MB for Gemma 3) is written once.
    spec = backend.to_str()
    if backend.padding is not None or backend.truncation is not None:
        copy = tokenizers.Tokenizer.from_str(spec)
        copy.no_padding()
        copy.no_truncation()
        spec = copy.to_str()
    # The logits may have more rows than the tokenizer has tokens (padded
    # embeddings): n_vocab covers them, and they are never allowed.
    n_vocab = max(vocab_size, len(tokenizer))
    return LLTokenizer(spec, n_vocab=n_vocab, eos_token=eos_token_ids)


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
