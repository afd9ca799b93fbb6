"""``SpeculativeConfig``: proposals of several tokens per step, verified in the same step.

Held by :class:`~kvserve.config.engine.EngineConfig` as ``speculative_config``
(None: no speculation, and no extra work in any step). Given as a dict, a
JSON object (``--speculative-config '{"method": "ngram", ...}'``) or an
instance, with vLLM's field names. The proposer (``core/ngram_proposer.py``,
``core/suffix_proposer.py``, or ``engine/draft_proposer.py`` for a draft
model) and the runner's verification read it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from kvserve.config.checks import require
from kvserve.errors import InvalidParameterError

_METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_CACHED_REQUESTS = 100_000


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding.

    method: where proposals come from. ``ngram`` (prompt lookup): the last
        n tokens of the request (n from prompt_lookup_max down to
        prompt_lookup_min) are looked for earlier in its own prompt and
        output, and the tokens that followed them are proposed. ``suffix``:
        the continuation seen most often after the context's longest suffix,
        in the request's own tokens and recent outputs. ``draft_model``: a
        smaller model (``model``) generates the proposals greedily.
    num_speculative_tokens: proposals per request and step, 1 to 16; each
        is one more query row of its request in the step.
    prompt_lookup_min, prompt_lookup_max: the shortest and longest n-gram
        the ngram method matches (1 <= min <= max <= 64).
    suffix_decoding_max_tree_depth: the longest suffix of the context the
        suffix method matches, 1 to 64; each indexed token costs about this
        many entries of memory.
    suffix_decoding_max_cached_requests: how many finished requests'
        outputs the suffix method keeps for later requests to match (the
        least recently finished is forgotten first); 0 keeps none. Smaller
        than vLLM's default because the store is plain Python dicts.
    suffix_decoding_min_token_prob: a token is proposed only while it
        followed the matched suffix at least this share of the times the
        suffix was seen (0 to 1).
    model: the draft model of the ``draft_model`` method (a folder, a .gguf
        file, an alias or a hub id, as ``model`` of the engine): a smaller
        model with the same tokenizer, which proposes the tokens it would
        generate greedily. It runs in its own engine, with its own KV pool
        and prefix cache, in the target's dtype and on its device. Required
        by ``draft_model``, refused by the other methods.
    adaptive: grant each request only the proposals expected to raise the
        step's tokens per second, from the step costs and the acceptance
        this engine measures as it runs (``core/spec_policy.py``): under load
        speculation turns itself off, and back on when load falls. False:
        every decoding request gets up to ``num_speculative_tokens``.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        require(
            self.method in _METHODS,
            "speculative_config.method",
            f"must be one of {_METHODS}, got {self.method!r}",
        )
        if self.method == "draft_model":
            require(
                isinstance(self.model, str) and self.model.strip() != "",
                "speculative_config.model",
                "the draft_model method needs the draft model (a folder, a .gguf file, an "
                f"alias or a hub id), got {self.model!r}",
            )
        else:
            require(
                self.model is None,
                "speculative_config.model",
                f"names a draft model, which only the draft_model method uses; with "
                f"method={self.method!r} leave it unset",
            )
        require(
            _is_int(self.num_speculative_tokens)
            and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            "speculative_config.num_speculative_tokens",
            f"must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
            f"got {self.num_speculative_tokens!r}",
        )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            require(
                _is_int(value) and 1 <= value <= 64,
                f"speculative_config.{name}",
                f"must be an integer from 1 to 64, got {value!r}",
            )
        require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative_config.prompt_lookup_min",
            f"must be at most prompt_lookup_max ({self.prompt_lookup_max}), "
            f"got {self.prompt_lookup_min}",
        )
        require(
            _is_int(self.suffix_decoding_max_tree_depth)
            and 1 <= self.suffix_decoding_max_tree_depth <= 64,
            "speculative_config.suffix_decoding_max_tree_depth",
            f"must be an integer from 1 to 64, got {self.suffix_decoding_max_tree_depth!r}",
        )
        require(
            _is_int(self.suffix_decoding_max_cached_requests)
            and 0 <= self.suffix_decoding_max_cached_requests <= MAX_CACHED_REQUESTS,
            "speculative_config.suffix_decoding_max_cached_requests",
            f"must be an integer from 0 to {MAX_CACHED_REQUESTS}, "
            f"got {self.suffix_decoding_max_cached_requests!r}",
        )
        prob = self.suffix_decoding_min_token_prob
        require(
            isinstance(prob, (int, float)) and not isinstance(prob, bool) and 0.0 <= prob <= 1.0,
            "speculative_config.suffix_decoding_min_token_prob",
            f"must be a number from 0 to 1, got {prob!r}",
        )

        require(
            isinstance(self.adaptive, bool),
            "speculative_config.adaptive",
            f"must be true or false, got {self.adaptive!r}",
        )

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig | None:
        """A config from what a user passes: None, an instance, a dict, or a JSON object text."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            text = value
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError(
                    "speculative_config", f"is not valid JSON ({exc.msg}): {text[:200]!r}"
                ) from None
        if not isinstance(value, dict):
            raise InvalidParameterError(
                "speculative_config",
                f"must be a dict, a JSON object or a SpeculativeConfig, got {type(value).__name__}",
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise InvalidParameterError(
                "speculative_config",
                f"unknown field(s) {unknown}; known: {known}",
            )
        kwargs: dict[str, Any] = dict(value)
        return cls(**kwargs)
