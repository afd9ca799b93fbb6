"""How the schedule demo shows its numbers: the tables (both runs, then the steps that
computed prompt tokens) and the figure (tokens per step by kind in both runs, and the
streams' inter-token latency)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvserve.demos.plotting import new_figure, save_png
from kvserve.demos.result import Table

# (data key, legend label, colour) of each kind of token in a step, bottom to top.
_KINDS = (
    ("decode_tokens", "decode (one token per stream)", "tab:blue"),
    ("partial_chunk_tokens", "prompt chunk (more to come)", "navajowhite"),
    ("last_chunk_tokens", "prompt chunk (last; samples)", "tab:orange"),
)
_MODE_COLORS = {"chunked": "tab:green", "unchunked": "tab:red"}
MODES = ("chunked", "unchunked")


def _label(mode: str) -> str:
    return "chunked prefill on" if mode == "chunked" else "chunked prefill off"


def plot(data: Mapping[str, Any], path: Path) -> None:
    modes: Mapping[str, Any] = data["modes"]
    figure, axes = new_figure(3, 1, width=10.0, height=9.0)
    longest_run = max(len(view["steps"]) for view in modes.values())
    for ax, (mode, view) in zip(axes[:2, 0], modes.items(), strict=True):
        steps = view["steps"]
        x = [step["step"] for step in steps]
        bottom = [0] * len(steps)
        for key, kind, color in _KINDS:
            heights = [step[key] for step in steps]
            ax.bar(x, heights, bottom=bottom, width=1.0, color=color, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.axhline(view["budget"], color="black", linestyle="--", linewidth=1)
        ax.annotate(
            f"budget {view['budget']}",
            (longest_run, view["budget"]),
            ha="right",
            va="bottom",
            fontsize="small",
        )
        ax.set_xlim(-0.5, longest_run + 0.5)
        # Log scale: the few decode tokens stay visible under prompt chunks 100x larger.
        ax.set_yscale("log")
        ax.set_ylim(1, view["budget"] * 2)
        ax.set_ylabel("tokens in the step (log scale)")
        ax.set_xlabel("engine step")
        largest = max((step["num_tokens"] for step in steps), default=0)
        ax.set_title(f"{_label(mode)}: {len(steps)} steps, the largest {largest} tokens")
    axes[0, 0].legend(loc="center right", fontsize="small")
    itl_ax = axes[2, 0]
    for mode, view in modes.items():
        color = _MODE_COLORS.get(mode, "tab:gray")
        for index, gaps in enumerate(view["stream_itl_ms"].values()):
            label: str | None = (
                f"{_label(mode)} (max {view['itl_max_ms']:.0f} ms)" if index == 0 else None
            )
            itl_ax.plot(range(1, len(gaps) + 1), gaps, color=color, alpha=0.6, label=label)
    itl_ax.set_yscale("log")
    itl_ax.set_xlabel("stream token number")
    itl_ax.set_ylabel("inter-token latency (ms, log scale)")
    itl_ax.set_title("Each decoding stream's gap between tokens (one line per stream)")
    itl_ax.legend(loc="upper right", fontsize="small")
    figure.suptitle("What the scheduler puts into each forward pass")
    save_png(figure, path)


def _chunk_text(chunk: Mapping[str, Any]) -> str:
    return f"{chunk['id']} {chunk['start']}-{chunk['end'] - 1}" + (
        " (part)" if chunk["partial"] else ""
    )


def tables(data: Mapping[str, Any]) -> tuple[Table, ...]:
    per_step = []
    for mode in MODES:
        view = data["modes"][mode]
        label = "on" if mode == "chunked" else "off"
        per_step.append(
            Table.build(
                f"Chunked prefill {label} (budget {view['budget']} tokens): the steps that "
                "computed prompt tokens (the others decode the streams only)",
                (
                    "step",
                    "decode tokens",
                    "prompt chunks (request tokens)",
                    "tokens",
                    "blocks used",
                    "ms",
                ),
                [
                    (
                        step["step"],
                        step["decode_tokens"],
                        "; ".join(_chunk_text(chunk) for chunk in step["chunks"]),
                        step["num_tokens"],
                        step["blocks_used"],
                        step["ms"],
                    )
                    for step in view["steps"]
                    if step["chunks"]
                ],
            )
        )
    summary = Table.build(
        "Both runs",
        (
            "chunked prefill",
            "budget",
            "steps",
            "largest step (tokens)",
            "stream ITL p50 ms",
            "p99 ms",
            "max ms",
            "wall s",
        ),
        [
            (
                "on" if mode == "chunked" else "off",
                view["budget"],
                len(view["steps"]),
                max((step["num_tokens"] for step in view["steps"]), default=0),
                view["itl_p50_ms"],
                view["itl_p99_ms"],
                view["itl_max_ms"],
                view["wall_s"],
            )
            for mode, view in data["modes"].items()
        ],
    )
    return (summary, *per_step)
