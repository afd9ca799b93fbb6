"""What a request's output must match: vLLM's ``StructuredOutputsParams``, validated.

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``,
``choice`` (a list of strings), ``grammar`` (Lark or GBNF/EBNF text) or
``json_object=True`` (any JSON object) is set. The checks here are the cheap
ones (types and the size limits below); whether a schema, regex or grammar
compiles is found out by the compiler (:mod:`kvserve.structured.compiler`).
This module is plain data, beside ``SamplingParams`` which holds it, so that
the base floor needs nothing from ``structured/`` above it.

Limits, so that one request cannot take the compiler or the step loop hostage:
a spec of at most :data:`MAX_SPEC_CHARS` characters, a JSON schema nested at
most :data:`MAX_SCHEMA_DEPTH` deep, at most :data:`MAX_CHOICES` choices of at
most :data:`MAX_CHOICE_CHARS` characters each.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidParameterError
from kvserve.json_limits import JsonTooDeepError, loads_bounded

MAX_SPEC_CHARS = 32768
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

PARAM = "structured_outputs"

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    """A validated spec in canonical form: the compile cache's key.

    kind: ``json`` (``text`` is the schema as JSON text), ``regex``, ``grammar``
        (Lark or GBNF text) or ``choice`` (``text`` is the choices as a JSON list).
    """

    kind: str
    text: str

    @property
    def digest(self) -> str:
        """The first 16 hex digits of the sha256 of :attr:`text` (UTF-8): logs name a spec so."""
        return hashlib.sha256(self.text.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    @property
    def label(self) -> str:
        """How logs name the spec: its kind, digest and length (a spec may be 32k characters)."""
        return f"{self.kind} spec sha256:{self.digest} ({len(self.text)} chars)"


@dataclass
class StructuredOutputsParams:
    """Constrain the output: set exactly one of the fields (vLLM's names).

    json: a JSON schema (dict or JSON text); the output is a JSON value that
        validates against it.
    regex: the output matches this regular expression (whole output).
    choice: the output is exactly one of these strings.
    grammar: the output is a sentence of this Lark or GBNF/EBNF grammar.
    json_object: the output is a JSON object, any.
    whitespace_flexible: let the model put any whitespace between JSON tokens
        (off by default: small models given the choice may emit newlines until
        max_tokens).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        self.spec = self._validate()

    def _validate(self) -> GrammarSpec:
        chosen = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidParameterError(
                PARAM,
                f"set exactly one of {', '.join(_KINDS)}; got {', '.join(chosen) or 'none'}",
            )
        if not isinstance(self.whitespace_flexible, bool):
            raise InvalidParameterError(f"{PARAM}.whitespace_flexible", "must be true or false")
        kind = chosen[0]
        if kind == "json_object":
            if self.json_object is not True:
                raise InvalidParameterError(f"{PARAM}.json_object", "must be true or false")
            return GrammarSpec("json", self._schema_text({"type": "object"}))
        if kind == "json":
            return GrammarSpec("json", self._schema_text(schema_dict(self.json)))
        if kind == "choice":
            return GrammarSpec("choice", json.dumps(_check_choices(self.choice)))
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise InvalidParameterError(f"{PARAM}.{kind}", "must be a non-empty string")
        _check_size(f"{PARAM}.{kind}", text)
        return GrammarSpec(kind, text)

    def _schema_text(self, schema: dict[str, Any]) -> str:
        # llguidance reads its options from the schema's "x-guidance" key.
        schema = {**schema, "x-guidance": {"whitespace_flexible": self.whitespace_flexible}}
        return json.dumps(schema, sort_keys=True)


def schema_dict(schema: object) -> dict[str, Any]:
    """A ``json`` spec as a schema object, checked (size, depth); InvalidParameterError if not.

    For callers that rewrite a schema (:mod:`kvserve.structured.schemas`)
    before it becomes a :class:`StructuredOutputsParams`: the rewrites walk
    only schemas checked here.
    """
    name = f"{PARAM}.json"
    if isinstance(schema, str):
        _check_size(name, schema)
        try:
            schema = loads_bounded(schema, MAX_SCHEMA_DEPTH)
        except JsonTooDeepError:
            raise InvalidParameterError(
                name, f"is nested too deep; at most {MAX_SCHEMA_DEPTH} levels are allowed"
            ) from None
        except ValueError as exc:
            raise InvalidParameterError(name, f"is not valid JSON: {exc}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidParameterError(name, "must be a JSON schema: an object (or its JSON text)")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidParameterError(
            name, f"is nested more than {MAX_SCHEMA_DEPTH} levels deep, the most allowed"
        )
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(name, f"cannot be written as JSON: {exc}") from None
    _check_size(name, text)
    return schema


def _check_choices(choices: object) -> list[str]:
    name = f"{PARAM}.choice"
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidParameterError(name, "must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidParameterError(name, f"at most {MAX_CHOICES} choices, got {len(choices)}")
    for choice in choices:
        if not isinstance(choice, str) or not 0 < len(choice) <= MAX_CHOICE_CHARS:
            raise InvalidParameterError(
                name, f"each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters"
            )
    return list(choices)


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidParameterError(
            name, f"has {len(text)} characters; at most {MAX_SPEC_CHARS} are allowed"
        )


def _depth(value: object) -> int:
    """Nesting depth of dicts and lists, without recursion (a hostile schema may be deep)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                break  # deep enough to refuse; no need to walk the rest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest
