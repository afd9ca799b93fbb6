"""What a run writes, kept current step by step, and what ``--resume`` reads back.

Under ``--out``: ``results.json`` (every step's status, time and findings),
``steps.log`` (every step's output), ``pytest.log`` (the CUDA tests') and, at
the end, ``bench.md``. The work folder holds ``results.json`` too, with every
step's full result: the exec executor's children and ``--resume`` read it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvserve.benchmarks.gpu_check.context import Context, Step

# Statuses that are a verdict: --resume keeps them; it runs again what was skipped or timed out.
VERDICTS = ("passed", "failed", "error")


def previous_run(work: Path) -> dict[str, tuple[dict[str, Any], dict[str, Any] | None]]:
    """The last run's verdicts in ``work``: step name -> (its entry, its result)."""
    path = work / "results.json"
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    results = doc.get("step_results", {})
    return {
        entry["name"]: (entry, results.get(entry["name"]))
        for entry in doc["steps"]
        if entry["status"] in VERDICTS
    }


class Record:
    """The run's document (``doc``) and its files."""

    def __init__(self, ctx: Context, deadline_s: float) -> None:
        self.ctx = ctx
        self.start = time.time()
        self.doc: dict[str, Any] = {
            "check": "kvserve GPU check (docs/cuda.md)",
            "dry_run": ctx.dry_run,
            "device": ctx.device,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv[1:],
            "work": str(ctx.work),
            "deadline_s": deadline_s,
            "steps": [],
        }
        (ctx.out / "steps.log").write_text("")
        self.save()

    def status(self, name: str) -> str | None:
        return next((s["status"] for s in self.doc["steps"] if s["name"] == name), None)

    def add(self, step: Step, entry: dict[str, Any]) -> None:
        log_path = self.ctx.work / "logs" / f"{step.name}.log"
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        if entry["status"] not in ("passed", "skipped") and text:
            entry.setdefault("log_tail", text.splitlines()[-30:])
        self.doc["steps"].append(entry)
        with open(self.ctx.out / "steps.log", "a") as steps_log:
            steps_log.write(
                f"\n===== {step.name}: {entry['status']} ({entry['seconds']} s)\n{text}"
            )
        if step.pytest_log:
            why = f"{step.name}: {entry['status']}, {entry.get('reason', '')}\n"
            (self.ctx.out / "pytest.log").write_text(text or why)
        reason = f": {entry['reason'][:200]}" if entry.get("reason") else ""
        resumed = ", from the last run (--resume)" if entry.get("resumed") else ""
        print(
            f"[gpu-check] {step.name}: {entry['status']} ({entry['seconds']} s{resumed}){reason}",
            flush=True,
        )
        self.save()

    def ok(self) -> bool:
        """Every selected step passed."""
        return all(
            s["status"] == "passed" or s.get("reason") == "not selected" for s in self.doc["steps"]
        )

    def finish(self) -> None:
        from kvserve.benchmarks.gpu_check.report import summarise

        self.doc["elapsed_s"] = round(time.time() - self.start, 1)
        summarise(self.doc, self.ctx.results, self.ctx.out)
        self.save()

    def save(self) -> None:
        """results.json under --out, and with the step results in the work folder."""
        for folder, doc in (
            (self.ctx.out, self.doc),
            (self.ctx.work, self.doc | {"step_results": self.ctx.results}),
        ):
            tmp = folder / "results.json.tmp"
            tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            tmp.rename(folder / "results.json")
