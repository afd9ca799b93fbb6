"""Operations whose result can dwarf their operands, sized before they run.

``'x' * 1000000000``, ``'x'.center(10**9)``, ``'%1000000000s' % 'x'`` or
``2 ** 10**10`` each build their whole result in one call into C: measuring
the result afterwards would be too late, the memory (or the hours) would be
spent. So each of them is sized from its operands first, and refused when
the result would be past the limit. Everything else is measured after it
runs (``RenderBudget.built``), which is safe because its result is at most
a small multiple of operands that were themselves measured.
"""

from __future__ import annotations

import codecs
import inspect
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.utils import generate_lorem_ipsum

from kvserve.chat.bounded_jinja.budget import RenderBudget, active
from kvserve.chat.bounded_jinja.limits import UNITS_PER_STEP

# Codecs implemented in C, in time linear in the text.
_LINEAR_CODECS = frozenset(
    (
        "utf-8",
        "utf-8-sig",
        "ascii",
        "iso8859-1",
        "cp1252",
        "utf-16",
        "utf-16-le",
        "utf-16-be",
        "utf-32",
        "utf-32-le",
        "utf-32-be",
        "unicode-escape",
        "raw-unicode-escape",
    )
)
# A %-format conversion's width and precision: digits, or * for the next argument.
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")
# The longest lorem ipsum word with its space and punctuation, and a paragraph's HTML.
_LIPSUM_CHARS_PER_WORD = 16
_LIPSUM_SIGNATURE = inspect.signature(generate_lorem_ipsum)

BINOPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "*": operator.mul,
    "**": operator.pow,
    "%": operator.mod,
}

# What + concatenates and * repeats.
_SEQUENCES = (str, bytes, list, tuple)


def binop(budget: RenderBudget, op: str, left: Any, right: Any) -> Any:
    """``left op right`` for one of :data:`BINOPS`, sized first, charged a step."""
    budget.step()
    if op == "*":
        _check_repeat(budget, left, right)
    elif op == "+":
        if isinstance(left, _SEQUENCES) and type(left) is type(right):
            budget.require_size(_size(budget, left) + _size(budget, right), "a +")
    elif op == "**":
        _check_power(budget, left, right)
    elif op == "%" and isinstance(left, (str, bytes)):
        check_percent_format(budget, left, right)
    return budget.built(BINOPS[op](left, right), f"a {op}")


def _size(budget: RenderBudget, value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes)) else budget.size_of(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int)  # bool too: True * 'x' is 'x'


def _check_repeat(budget: RenderBudget, left: Any, right: Any) -> None:
    if _is_int(left) and _is_int(right):
        budget.require_int_bits(left.bit_length() + right.bit_length(), "a *")
        return
    sequence, count = (left, right) if _is_int(right) else (right, left)
    if isinstance(sequence, _SEQUENCES) and _is_int(count) and count > 0:
        budget.require_size(
            _size(budget, sequence) * count, f"a sequence of {len(sequence)} repeated {count} times"
        )


def _check_power(budget: RenderBudget, base: Any, exponent: Any) -> None:
    if _is_int(base) and _is_int(exponent) and exponent > 0 and abs(base) > 1:
        budget.require_int_bits(base.bit_length() * exponent, "a **")


def check_percent_format(budget: RenderBudget, template: str | bytes, args: Any) -> None:
    """Refuse a %-format whose widths or precisions would build too much text."""
    text = template.decode("latin-1") if isinstance(template, bytes) else template
    star = False
    for match in _PERCENT_SPEC.finditer(text):
        for number in match.groups():
            if number == "*":
                star = True
            elif number is not None:
                budget.require_size(int(number), "a %-format width")
    if star:
        for arg in args if isinstance(args, tuple) else (args,):
            if _is_int(arg):
                budget.require_size(abs(arg), "a %-format width")


def check_format_spec(budget: RenderBudget, spec: str) -> None:
    """Refuse a ``str.format`` field whose width or precision would build too much text."""
    for number in _DIGITS.findall(spec):
        budget.require_size(int(number), "a format width")


def checked_method_args(
    budget: RenderBudget, method: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Any, ...]:
    """``args`` for a call of ``method``, once its result's size is known to be in bounds.

    Only methods of strings, bytes and integers can build more than their
    operands hold; the arguments come back as given, but for ``join``, whose
    items are gathered first so that they can be measured.
    """
    owner = getattr(method, "__self__", None)
    name = getattr(method, "__name__", "")
    if isinstance(owner, (str, bytes)):
        if name == "join" and args:
            items = gather(budget, args[0], separator=owner)
            return (items, *args[1:])
        if name in ("encode", "decode"):
            _check_codec(args[0] if args else kwargs.get("encoding", "utf-8"))
        if name == "striptags" and isinstance(owner, str):  # markupsafe's Markup
            charge_striptags(budget, owner)
        check = _TEXT_METHOD_CHECKS.get(name)
        if check is not None:
            budget.require_size(check(owner, args, kwargs), f"{type(owner).__name__}.{name}")
    elif _is_int(owner) and name == "to_bytes":
        budget.require_size(_arg(args, kwargs, 0, "length", 1), "int.to_bytes")
    return args


def charge_striptags(budget: RenderBudget, text: str) -> None:
    """Charge for stripping tags, which copies the rest of the text once per tag."""
    budget.step(len(text) * (1 + text.count("<")) // UNITS_PER_STEP)


def _check_codec(encoding: Any) -> None:
    """Refuse a codec written in Python (punycode takes quadratic time, idna is slow)."""
    if not isinstance(encoding, str) or codecs.lookup(encoding).name not in _LINEAR_CODECS:
        raise SecurityError(f"the codec {encoding!r} is not available to templates")


def gather(budget: RenderBudget, items: Any, separator: str | bytes) -> list[Any]:
    """The items of a join, stopped as soon as their joined text would be past the limit."""
    gathered: list[Any] = []
    size = 0
    for item in items:
        size += len(item) if isinstance(item, (str, bytes)) else 0
        size += len(separator) if gathered else 0
        budget.require_size(size, "a join")
        gathered.append(item)
    return gathered


def _arg(
    args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str, default: Any
) -> Any:
    value = args[index] if len(args) > index else kwargs.get(name, default)
    return value if _is_int(value) else 0


def replaced_size(text: str | bytes, old: Any, new: Any, count: Any) -> int:
    """The length of ``text.replace(old, new, count)``, without building it."""
    if not isinstance(old, type(text)) or not isinstance(new, type(text)):
        return 0  # the call raises TypeError
    occurrences = text.count(old) if old else len(text) + 1  # type: ignore[arg-type]
    if _is_int(count) and count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * (len(new) - len(old))


def _translated_size(text: str | bytes, table: Any) -> int:
    if not isinstance(table, Mapping):
        return len(text)
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
    return len(text) * max(longest, 1)


def _tab_size(text: str | bytes, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    tab = "\t" if isinstance(text, str) else b"\t"
    return len(text) + text.count(tab) * _arg(args, kwargs, 0, "tabsize", 8)  # type: ignore[arg-type]


_TextCheck = Callable[[Any, Sequence[Any], Mapping[str, Any]], int]
_TEXT_METHOD_CHECKS: dict[str, _TextCheck] = {
    "center": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "ljust": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "rjust": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "zfill": lambda s, a, k: _arg(a, k, 0, "width", 0),
    "expandtabs": _tab_size,
    "replace": lambda s, a, k: replaced_size(
        s, a[0] if a else None, a[1] if len(a) > 1 else None, a[2] if len(a) > 2 else -1
    ),
    "translate": lambda s, a, k: _translated_size(s, a[0] if a else None),
}


def lipsum(*args: Any, **kwargs: Any) -> Any:
    """Jinja's ``lipsum(n, html, min, max)`` global, sized first: ``n`` paragraphs of
    at most ``max`` words."""
    arguments = _LIPSUM_SIGNATURE.bind(*args, **kwargs)
    arguments.apply_defaults()
    paragraphs, words = (arguments.arguments[name] for name in ("n", "max"))
    if _is_int(paragraphs) and _is_int(words):
        size = max(paragraphs, 0) * max(words, 0) * _LIPSUM_CHARS_PER_WORD
        active().require_size(size, "lipsum")
    return generate_lorem_ipsum(*args, **kwargs)
