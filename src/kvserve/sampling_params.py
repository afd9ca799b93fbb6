"""Sampling parameters of one request, validated when constructed.

The names and defaults follow vLLM's ``SamplingParams`` so code written for it
runs unchanged. ``temperature == 0`` means greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.errors import InvalidParameterError
from kvserve.structured_params import StructuredOutputsParams

# A stop string longer than this, or more stop strings than this, is refused:
# stop checks run on every generated token.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20


def _check_number(name: str, value: object, *, integer: bool = False) -> float:
    """Reject bools, non-numbers and NaN/inf before any range check."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise InvalidParameterError(name, f"must be {kind}, got {value!r}")
    if integer and not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParameterError(name, f"must be finite, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    n: number of completions to return for the prompt.
    temperature: 0 is greedy; higher flattens the distribution.
    top_p: keep the smallest set of tokens whose probability sums to top_p, in (0, 1].
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    min_p: drop tokens whose probability is below min_p times the top one, in [0, 1].
    seed: a per-request seed; the same seed gives the same tokens whatever
        else is in the batch.
    stop: strings that end the completion; the stop string is not returned
        unless include_stop_str_in_output.
    stop_token_ids: token ids that end the completion (the token is kept in
        token_ids, its text is not added).
    ignore_eos: keep generating past the end-of-sequence token.
    max_tokens: the most tokens to generate, >= 1.
    min_tokens: EOS and stop tokens are suppressed until this many were generated.
    logprobs: also return the log probability of each sampled token and of
        this many most likely alternatives (0 returns only the sampled one).
    prompt_logprobs: also return, for every prompt token after the first, its
        log probability given the tokens before it and this many most likely
        alternatives (0 returns only the prompt token's); the first position
        has none. Such a request computes its whole prompt: it takes no
        prefix-cache hit (see ``core/scheduler.py``).
    presence_penalty, frequency_penalty: OpenAI-style penalties in [-2, 2] on
        tokens already generated.
    repetition_penalty: CTRL-style penalty (> 0, 1 means none) on tokens in
        the prompt or the output.
    skip_special_tokens: leave special tokens out of the returned text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    structured_outputs: constrain the output to a JSON schema, regex, choice or
        grammar (see :class:`~kvserve.structured.StructuredOutputsParams`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Normalised copy of ``stop`` as a list; filled in by __post_init__.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _validate(self) -> None:
        _check_number("n", self.n, integer=True)
        if self.n < 1:
            raise InvalidParameterError("n", f"must be at least 1, got {self.n}")
        if _check_number("temperature", self.temperature) < 0:
            raise InvalidParameterError("temperature", f"must be >= 0, got {self.temperature}")
        top_p = _check_number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        if _check_number("top_k", self.top_k, integer=True) < -1:
            raise InvalidParameterError(
                "top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}"
            )
        min_p = _check_number("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise InvalidParameterError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**63:
                raise InvalidParameterError("seed", f"must be in [0, 2**63), got {self.seed}")
        _check_number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 1:
            raise InvalidParameterError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParameterError(
                "min_tokens",
                f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_number(name, value, integer=True)
            if not 0 <= value <= MAX_LOGPROBS:
                raise InvalidParameterError(
                    name, f"must be None or in [0, {MAX_LOGPROBS}], got {value}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidParameterError(name, f"must be in [-2, 2], got {value}")
        if _check_number("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidParameterError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        self._validate_stops()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidParameterError(
                "structured_outputs", "must be a StructuredOutputsParams or None"
            )

    def _validate_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None:
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise InvalidParameterError("stop", "must be a string or a list of strings")
            if len(stops) > MAX_STOP_STRINGS:
                raise InvalidParameterError(
                    "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
                )
            for s in stops:
                if not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                    raise InvalidParameterError(
                        "stop",
                        f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters",
                    )
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise InvalidParameterError("stop_token_ids", "must be a list of token ids")
            for token_id in self.stop_token_ids:
                if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                    raise InvalidParameterError(
                        "stop_token_ids", f"must hold non-negative integers, got {token_id!r}"
                    )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a stop token id lies outside the model's vocabulary."""
        for token_id in self.stop_token_ids or []:
            if token_id >= vocab_size:
                raise InvalidParameterError(
                    "stop_token_ids",
                    f"token id {token_id} is outside the vocabulary [0, {vocab_size})",
                )
