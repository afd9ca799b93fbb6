"""JSON schema rewrites: OpenAI's strict mode, and schemas nested under a wrapper.

:func:`strict_schema` gives a schema the meaning OpenAI's ``strict: true``
gives it: every object has no properties beyond those it lists and has all of
them. :func:`nest_schema` moves a schema under a wrapper's ``$defs`` so that
its own ``$ref``s (``#/$defs/P``, ``#``) still resolve there (a forced tool
call's schema wraps each tool's parameters).

Both walk the schema without recursion (a hostile schema may be deep; the
request checks bound it to ``MAX_SCHEMA_DEPTH`` levels anyway) and return a
new schema, leaving the caller's untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SCHEMA = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` under OpenAI's strict mode: closed objects, every listed property required.

    Every object schema (``type`` ``object``, or ``properties`` given) that
    does not say ``additionalProperties`` gets ``additionalProperties: false``;
    its ``required`` becomes all of its ``properties`` (those it required
    first, then the rest in order). What validates against the result
    validates against ``schema``. Objects that are ``allOf`` branches, or
    combine ``allOf``, are left open: closing each branch would refuse the
    properties of the others.
    """
    result = copy.deepcopy(schema)
    for node, in_all_of in _subschemas(result):
        if in_all_of or "allOf" in node or not _is_object_schema(node):
            continue
        node.setdefault("additionalProperties", False)
        properties = node.get("properties")
        if isinstance(properties, dict) and properties:
            required = node.get("required")
            required = (
                [name for name in required if isinstance(name, str)]
                if isinstance(required, list)
                else []
            )
            node["required"] = required + [name for name in properties if name not in required]
    return result


def nest_schema(schema: dict[str, Any], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` to be kept at ``#/$defs/<key>`` of a wrapper, and the reference to put in its place.

    Every local ``$ref`` (``#`` or ``#/...``) is rewritten to point below
    ``#/$defs/<key>``, so that references to the schema's own ``$defs``
    (``#/$defs/P``) or to its root (``#``, a recursive schema) resolve from the
    wrapper's root. ``key`` must not need JSON pointer escapes (no ``~`` or ``/``).
    """
    if "~" in key or "/" in key:
        raise ValueError(f"a $defs key without JSON pointer escapes, got {key!r}")
    nested = copy.deepcopy(schema)
    prefix = f"#/$defs/{key}"
    for node, _ in _subschemas(nested):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = prefix + ref[1:]
    return nested, {"$ref": prefix}


def _is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and isinstance(node.get("properties"), dict)


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[dict[str, Any], bool]]:
    """Every schema object in ``schema`` (itself included), with whether it is an allOf branch.

    Values that are data, not schemas (``const``, ``enum``, ``default``,
    ``examples``), are not entered.
    """
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, in_all_of = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false schemas, or a malformed value the compiler will refuse
        yield node, in_all_of
        for keyword in _SCHEMA:
            if isinstance(node.get(keyword), dict):
                stack.append((node[keyword], False))
        for keyword in _SCHEMA_LISTS:
            if isinstance(node.get(keyword), list):
                stack.extend((child, keyword == "allOf") for child in node[keyword])
        for keyword in _SCHEMA_MAPS:
            if isinstance(node.get(keyword), dict):
                stack.extend((child, False) for child in node[keyword].values())
