"""Templates rendered under limits: hostile ones stop at a limit, in the thread, without the memory."""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import jinja2
import pytest

from kvserve.chat.bounded_jinja import (
    LIMITS_ENV,
    TemplateLimitError,
    TemplateLimits,
    limits_from_env,
    render_template,
)
from kvserve.errors import InvalidParameterError

# Small limits, so that each refusal is quick; an hour of wall time, so that every
# refusal but the clock's own is the work or the size counted, not the seconds.
SMALL = TemplateLimits(max_steps=20_000, max_chars=100_000, max_seconds=3600)
NESTED_RANGES = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def render(source: str, limits: TemplateLimits = SMALL, **variables: Any) -> str:
    return render_template(source, variables, limits)


def limit_hit(source: str, limits: TemplateLimits = SMALL, **variables: Any) -> str:
    with pytest.raises(TemplateLimitError) as caught:
        render(source, limits, **variables)
    return caught.value.limit


def test_nested_huge_ranges_stop_at_the_step_limit() -> None:
    for max_steps in (1_000, 20_000):
        limits = TemplateLimits(max_steps=max_steps, max_seconds=3600)
        with pytest.raises(TemplateLimitError, match=f"more than {max_steps} steps") as caught:
            render(NESTED_RANGES, limits)
        assert caught.value.limit == "steps"


def test_string_repetition_is_refused_before_it_is_built() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimitError, match="1000000000") as caught:
            render("{{ 'x' * 1000000000 }}")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.limit == "chars"
    assert peak < 20 * 2**20  # the gigabyte was never asked for


def test_the_clock_stops_a_render_the_step_limit_would_let_run() -> None:
    limits = TemplateLimits(max_steps=10**9, max_seconds=0.2)
    started = time.monotonic()
    assert limit_hit(NESTED_RANGES, limits) == "seconds"
    assert time.monotonic() - started < 30  # ~0.2 s; generous for a loaded machine


def test_a_template_longer_than_the_limit_is_not_compiled() -> None:
    limits = TemplateLimits(max_template_chars=1000)
    assert render("x" * 1000, limits) == "x" * 1000
    assert limit_hit("x" * 1001, limits) == "template_chars"


# Each builds, in one call or a few, far more than it was given, or loops far
# longer than any chat template does. The limit it must stop at is named.
HOSTILE = {
    "center": ("{{ 'x'.center(1000000000) }}", "chars"),
    "ljust": ("{{ 'x'.ljust(1000000000) }}", "chars"),
    "zfill": ("{{ '1'.zfill(1000000000) }}", "chars"),
    "expandtabs": ("{{ ('\t' * 1000).expandtabs(1000000) }}", "chars"),
    "str.replace": ("{{ ('x' * 50000).replace('', 'yyyyy') }}", "chars"),
    "str.join": ("{{ ('x' * 1000).join(['a'] * 50000) }}", "chars"),
    "translate": ("{{ ('a' * 1000).translate({97: 'b' * 1000}) }}", "chars"),
    "to_bytes": ("{{ (1).to_bytes(1000000000, 'big') }}", "chars"),
    "percent width": ("{{ '%1000000000s' % 'x' }}", "chars"),
    "percent star": ("{{ '%*s' % (1000000000, 'x') }}", "chars"),
    "format width": ("{{ '{:>1000000000}'.format('x') }}", "chars"),
    "nested format width": ("{{ '{:>{}}'.format('x', 1000000000) }}", "chars"),
    "format filter": ("{{ '%1000000000d'|format(1) }}", "chars"),
    "power": ("{{ 2 ** 10000000000 }}", "chars"),
    "squaring": (
        "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}",
        "chars",
    ),
    "list repetition": ("{{ ([1] * 1000000000)|length }}", "chars"),
    "nested lists": ("{% set a = ['xxxx'] %}" + "{% set a = [a, a] %}" * 40 + "{{ a }}", "chars"),
    "dict views": (
        "{% set d = {'k': 'x' * 50000} %}"
        + "{% set d = {'a': d.items(), 'b': d.items()} %}" * 10
        + "{{ d }}",
        "chars",
    ),
    "concatenation doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "chars",
    ),
    "set block doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
        "{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}{% endfor %}",
        "chars",
    ),
    "macro doubling": (
        "{% macro twice(s, n) %}{% if n %}{{ twice(s ~ s, n - 1) }}{% else %}{{ s }}"
        "{% endif %}{% endmacro %}{{ twice('x', 64) }}",
        "chars",
    ),
    "output": ("{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}", "chars"),
    "indent": ("{{ 'a\nb'|indent(1000000000) }}", "chars"),
    "center filter": ("{{ 'x'|center(1000000000) }}", "chars"),
    "replace filter": ("{{ ('x' * 50000)|replace('x', 'yyyyy') }}", "chars"),
    "wordwrap": ("{{ ('x' * 10000)|wordwrap(1, wrapstring='y' * 20) }}", "chars"),
    "batch": ("{{ (range(3)|batch(1000000000, 'x')|list)|length }}", "chars"),
    "slice": ("{{ ([1]|slice(1000000000)|list)|length }}", "chars"),
    "join of a generator": ("{{ range(200)|map('center', 1000)|join }}", "chars"),
    # Each + copies the sum so far: quadratic work, charged by the size it copies.
    "sum of lists": ("{{ ([['x'] * 100] * 100)|sum(start=[]) }}", "steps"),
    "tojson indent": ("{{ [[1]]|tojson(indent=1000000000) }}", "chars"),
    "lipsum": ("{{ lipsum(1000000000) }}", "chars"),
    "recursive loop": (
        "{% for x in range(3) recursive %}{{ loop(range(99999)) if loop.depth < 3 }}{% endfor %}",
        "steps",
    ),
    "loop over the loop's length": (
        "{% for i in range(99999) %}{% for j in range(loop.length) %}{% endfor %}{% endfor %}",
        "steps",
    ),
    # Slow work per character, charged before it starts.
    "urlize": ("{{ ('x ' * 25000)|urlize }}", "steps"),
    "sort": ("{{ ('x' * 50000)|sort|length }}", "steps"),
    "select": ("{{ ('x' * 50000)|select|list|length }}", "steps"),
    # Stripping tags copies the rest of the text once per tag.
    "striptags": ("{{ ('<a>' * 2000)|striptags }}", "steps"),
    "Markup.striptags": ("{{ (('<a>' * 2000)|safe).striptags() }}", "steps"),
    "loop over characters": (
        "{% for c in messages[0].content %}{% for d in messages[0].content %}{% endfor %}"
        "{% endfor %}",
        "steps",
    ),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_stops_at_its_limit(name: str) -> None:
    source, limit = HOSTILE[name]
    messages = [{"role": "user", "content": "x" * 5000}]
    assert limit_hit(source, messages=messages) == limit


def test_constant_expressions_are_charged_too() -> None:
    # Jinja folds constant expressions while compiling; none may escape the budget that way.
    assert limit_hit("{{ ('x' * 3)|center(1000000000) }}") == "chars"
    assert limit_hit("{{ 'x'|center(1000000000) ~ 'y' }}") == "chars"


def test_a_template_cannot_reach_past_the_sandbox() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ [].append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_hidden=1) %}")
    assert render("{{ ''.__class__ }}") == ""  # undefined, not the class
    # Punycode, written in Python, takes quadratic time: only C codecs are offered.
    with pytest.raises(jinja2.exceptions.SecurityError, match="punycode"):
        render("{{ 'x'.encode('punycode') }}")
    assert render("{{ 'é'.encode('utf-8').decode('latin-1') }}") == "Ã©"


def test_ordinary_templates_render_as_jinja_renders_them() -> None:
    source = (
        "{% set ns = namespace(count=0) %}{% for m in messages if m.role != 'system' %}"
        "{% set ns.count = ns.count + 1 %}{{ loop.index }}/{{ loop.length }} "
        "{{ m.role|upper }}: {{ m.content|trim }}{{ '\n' if not loop.last }}{% endfor %}"
        "|{{ ns.count }}|{{ tools|tojson }}|{{ '%05.1f' % 3.14159 }}|{{ '{:>4}'.format(7) }}"
        "|{{ [1, 2, 3]|join(', ') }}|{{ [1, 2]|sum }}|{{ 'a-b'|replace('-', '+') }}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"name": "f", "parameters": {}}]
    expected = jinja2.Environment().from_string(source).render(messages=messages, tools=tools)
    assert render(source, messages=messages, tools=tools) == expected


def test_the_defaults_are_generous_and_the_environment_overrides_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(LIMITS_ENV, raising=False)
    defaults = limits_from_env()
    assert defaults == TemplateLimits()
    assert defaults.max_steps >= 1_000_000 and defaults.max_chars >= 4 * 2**20
    monkeypatch.setenv(LIMITS_ENV, "steps=5000, seconds=0.5")
    assert limits_from_env() == TemplateLimits(max_steps=5000, max_seconds=0.5)
    monkeypatch.setenv(LIMITS_ENV, "turns=5")
    with pytest.raises(InvalidParameterError, match="unknown limit 'turns'"):
        limits_from_env()
    monkeypatch.setenv(LIMITS_ENV, "steps=0")
    with pytest.raises(InvalidParameterError, match="max_steps"):
        limits_from_env()
