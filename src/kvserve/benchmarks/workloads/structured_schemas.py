"""Twenty varied JSON schemas: the structured-outputs tests' and benchmark's workload.

Nested objects, arrays, enums, bounded numbers, patterns, required and optional
fields, ``$ref``. Every object is closed (``additionalProperties: false``) and
every string and array bounded, so that a small model cannot ramble inside one.
:func:`open_schema` gives each as a client would often write it: the same but
for ``additionalProperties``, left unsaid.
"""

from __future__ import annotations

from typing import Any


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object: no property besides ``properties`` (a small model would add more)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "boolean flag": obj({"answer": {"type": "boolean"}}),
    "enum colour": obj({"colour": {"enum": ["red", "green", "blue"]}}),
    "bounded number": obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    "optional fields": obj({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, ["city"]),
    "array of ints": obj(
        {"primes": {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 97}, "minItems": 1, "maxItems": 5}}
    ),
    "array of enums": obj(
        {"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "maxItems": 3}}
    ),
    "nested object": obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME})}),
    "two levels deep": obj({"a": obj({"b": obj({"c": {"type": "string", "maxLength": 10}})})}),
    "array of objects": obj(
        {"items": {"type": "array", "items": obj({"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}), "minItems": 1, "maxItems": 3}}
    ),
    "const and enum": obj({"version": {"const": 2}, "level": {"enum": ["low", "high"]}}),
    "nullable": obj({"note": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]}}),
    "one of shapes": obj(
        {"shape": {"anyOf": [obj({"radius": {"type": "integer", "minimum": 1, "maximum": 10}}), obj({"side": {"type": "integer", "minimum": 1, "maximum": 10}})]}}
    ),
    "date pattern": obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}}),
    "string array bounded": obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}}),
    "mixed types": obj(
        {"title": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999}, "available": {"type": "boolean"}, "rating": {"type": "number", "minimum": 0, "maximum": 5}}
    ),
    "refs": {
        "$defs": {"point": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
        **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "exclusive bounds": obj({"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "top-level array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    "optional nested": obj({"id": {"type": "integer", "minimum": 0, "maximum": 99}, "meta": obj({"source": NAME})}, ["id"]),
}  # fmt: skip


def open_schema(schema: Any) -> Any:
    """``schema`` with every ``additionalProperties: false`` left out (objects open again)."""
    if isinstance(schema, dict):
        return {
            key: open_schema(value)
            for key, value in schema.items()
            if not (key == "additionalProperties" and value is False)
        }
    if isinstance(schema, list):
        return [open_schema(value) for value in schema]
    return schema
