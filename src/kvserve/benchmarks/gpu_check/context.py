"""What every step of the check is given, and what a step is (no heavy imports here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Context:
    """repo: the repository root (the working directory); out: where the result files go;
    work: scratch (models, bench JSON, step logs); dry_run: on the CPU with tiny models;
    tokenizer: the folder of SmolLM2's tokenizer files; break_step: a step to fail on
    purpose; models: the models the selected steps need; results: the results of the
    steps run so far, by name."""

    repo: Path
    out: Path
    work: Path
    dry_run: bool
    tokenizer: Path
    break_step: str | None = None
    models: tuple[str, ...] = ()
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def model_path(self, name: str) -> str:
        """The folder of random-weight model ``name``, built by the ``models`` step."""
        return str(self.results["models"]["models"][name]["path"])


@dataclass(frozen=True)
class Step:
    """One step: ``run(ctx)`` returns its result, whose ``problems`` (a list of strings) fail it.

    section: where results.json files its result; budget_s: its time limit (the dry
    run's too, on a small and maybe busy CPU); needs: steps that must have passed first;
    models: the random-weight models it runs; pytest_log: its output is also
    $OUT/pytest.log.
    """

    name: str
    section: str
    run: Callable[[Context], dict[str, Any]]
    budget_s: float
    needs: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    pytest_log: bool = False
