"""What a demo runs on: the model, its precision, a seed, extra engine arguments and
workload sizes a test may shrink.

A demo describes its workload with a frozen dataclass of sizes (prompt
counts, token limits, ...) whose defaults are the real demo. Tests pass
``sizes={"max_tokens": 8}`` and the demo's :meth:`DemoContext.resolve_sizes`
returns its defaults with those fields replaced, so a shrunken run takes the
same code path as the real one.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.config import ModelConfig
from kvserve.errors import InvalidParameterError

if TYPE_CHECKING:
    from kvserve.engine import LLMEngine

DEFAULT_MODEL = ModelConfig.model
# Engine arguments that the context's own fields set.
_OWN_ARGS = ("model", "dtype", "seed")

SizesT = TypeVar("SizesT")


@dataclass(frozen=True)
class DemoContext:
    """How to run a demo.

    model: path, alias or hub id of the model (default SmolLM2-135M-Instruct).
    dtype: the weights' precision (``auto``, ``float32``, ``bfloat16``).
    seed: seeds the engine and every random workload a demo draws.
    engine_args: extra engine arguments for every engine a demo builds
        (``block_size``, ``kv_cache_dtype``, ...); one that the demo sets
        itself is refused, since the demo depends on its value.
    sizes: replaces fields of the demo's sizes dataclass (tests shrink the
        workload this way); an unknown field is refused, naming the known ones.
    verbose: print progress lines to standard error.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    seed: int = 0
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    sizes: Mapping[str, Any] = field(default_factory=dict)
    verbose: bool = False

    def __post_init__(self) -> None:
        for name in _OWN_ARGS:
            if name in self.engine_args:
                raise InvalidParameterError(
                    "engine_args", f"{name!r} is a field of the demo context; set it there"
                )

    def engine(self, **demo_args: Any) -> LLMEngine:
        """A fresh engine on the context's model with ``engine_args`` and the demo's own arguments."""
        for name in demo_args:
            if name in self.engine_args:
                raise InvalidParameterError(
                    name, "is set by the demo itself; leave it out of engine_args"
                )
        from kvserve.engine import LLMEngine  # imports torch

        return LLMEngine.from_engine_args(
            self.model, dtype=self.dtype, seed=self.seed, **self.engine_args, **demo_args
        )

    def resolve_sizes(self, defaults: SizesT) -> SizesT:
        """``defaults`` (a dataclass instance) with the fields named in ``sizes`` replaced."""
        known = {f.name for f in dataclasses.fields(defaults)}  # type: ignore[arg-type]
        unknown = sorted(set(self.sizes) - known)
        if unknown:
            raise InvalidParameterError(
                "sizes", f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(defaults, **self.sizes)  # type: ignore[type-var]

    def describe(self) -> dict[str, Any]:
        """The settings a result was produced with, for its JSON."""
        return {
            "model": self.model,
            "dtype": self.dtype,
            "seed": self.seed,
            "engine_args": dict(self.engine_args),
            "sizes": dict(self.sizes),
        }

    def progress(self, message: str) -> None:
        if self.verbose:
            print(message, file=sys.stderr, flush=True)
