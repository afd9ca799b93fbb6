"""A Jinja sandbox that charges every piece of a template's work to the render's budget.

Jinja's sandbox decides what a template may *reach*; this environment also
bounds what it may *do*, through the hooks the sandbox offers and a code
generator that routes the rest through the environment:

- calls (functions, methods, macros, ``loop(...)`` of recursive loops) go
  through :meth:`BoundedEnvironment.call`, attribute and item lookups
  through :meth:`getattr` and :meth:`getitem`, ``+ * ** %`` through
  :meth:`call_binop`: a step each; ``str.format`` through a formatter that
  sizes each field; filters are wrapped (``filters.py``): a step each,
  results measured;
- the generated code counts a step per item of every ``for`` loop, measures
  list, tuple and dict literals and ``~`` concatenations, and writes macro
  and ``{% set %}`` block text into buffers that count what they hold.

Tests (``is defined``), slicing and comparisons are not charged: each costs
at most the size of values already measured, and runs between two steps.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
)
from markupsafe import Markup

from kvserve.chat.bounded_jinja import hf_compat
from kvserve.chat.bounded_jinja.budget import CountedIterator, RenderBudget, active
from kvserve.chat.bounded_jinja.filters import bounded_filters
from kvserve.chat.bounded_jinja.ops import (
    BINOPS,
    binop,
    check_format_spec,
    checked_method_args,
    lipsum,
)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with the hooks that charge loops, literals and text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The iterables of the for loops seen so far (Jinja allows no custom node
        # type to wrap them in): each is written inside environment.counted(...).
        self._loop_iterables: set[int] = set()

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self._loop_iterables.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        self.write("environment.counted(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self.write("environment.built(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self.write("environment.built(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment target: {% set a, b = ... %}
            super().visit_Tuple(node, frame)
            return
        self.write("environment.built(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concatenated((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def buffer(self, frame: Frame) -> None:
        # Macros, call and filter blocks, {% set %} blocks and recursive loops write here.
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.text_buffer()")


class TextBuffer(list[str]):
    """The list Jinja collects a macro's or block's text in, counting what it is given."""

    def __init__(self, budget: RenderBudget) -> None:
        super().__init__()
        self._budget = budget

    def append(self, text: str) -> None:
        self._budget.wrote(len(text))
        super().append(text)

    def extend(self, texts: Iterable[str]) -> None:
        texts = tuple(texts)
        self._budget.wrote(sum(map(len, texts)))
        super().extend(texts)


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` that refuses a field whose width would build too much text."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        check_format_spec(active(), format_spec)
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    pass


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox chat templates render in: transformers' setup, every step charged.

    Renders only inside :func:`~kvserve.chat.bounded_jinja.budget.activated`; the
    generated code calls :meth:`counted`, :meth:`built`, :meth:`concatenated` and
    :meth:`text_buffer`.
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(BINOPS)

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[hf_compat.GenerationTag, loopcontrols],
        )
        hf_compat.install(self)
        self.globals["lipsum"] = lipsum
        self.filters = bounded_filters(self.filters)

    def call(
        __self,
        __context: Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        budget = active()
        budget.step()
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop
            args = (budget.counted(args[0]), *args[1:])
        args = checked_method_args(budget, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.built(result, "a call's result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        active().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        active().step()
        return super().getitem(obj, argument)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        return binop(active(), operator, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or (
            value.__name__ not in ("format", "format_map")
        ):
            return None
        text = value.__self__
        if not isinstance(text, str):
            return None
        formatter: SandboxedFormatter
        if isinstance(text, Markup):
            formatter = _BoundedEscapeFormatter(self, escape=text.escape)
        else:
            formatter = _BoundedFormatter(self)
        is_format_map = value.__name__ == "format_map"

        def format_text(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                return type(text)(formatter.vformat(text, (), args[0]))
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(format_text, value)

    # Called by the generated code (see _BoundedCodeGenerator).

    def counted(self, iterable: Iterable[Any]) -> CountedIterator:
        return active().counted(iterable)

    def built(self, value: Any) -> Any:
        return active().built(value, "a literal")

    def concatenated(self, parts: tuple[Any, ...]) -> str:
        budget = active()
        budget.step()
        texts = [str(part) for part in parts]
        budget.require_size(sum(map(len, texts)), "a ~ concatenation")
        return budget.built("".join(texts), "a ~ concatenation")

    def text_buffer(self) -> TextBuffer:
        return TextBuffer(active())
