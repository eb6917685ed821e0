"""Draws a simulated timeline: plain text for a terminal, PNG through matplotlib (optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from d9d.pipeline._actions import ActionKind
from d9d.pipeline._timed_action import TimedAction


class SimulatedTimeline(Protocol):
    """What the drawings read of a simulation (``SimulationResult`` fits)."""

    @property
    def timeline(self) -> Sequence[Sequence[TimedAction]]: ...

    @property
    def makespan(self) -> float: ...

    @property
    def bubble_fraction(self) -> float: ...

    @property
    def peak_live_activations(self) -> Sequence[int]: ...


_COLORS = {
    ActionKind.FORWARD: "#4c72b0",
    ActionKind.BACKWARD: "#55a868",
    ActionKind.BACKWARD_INPUT: "#8fd175",
    ActionKind.BACKWARD_WEIGHT: "#dd8452",
}


def draw_timeline_text(result: SimulatedTimeline, *, width: int | None = None) -> str:
    """Draws one row per rank; two cells per time unit of the shortest action.

    A compute action prints as its kind letter and microbatch, padded with ``-`` to its length
    (``F3`` for a 1-unit forward of microbatch 3, ``B3--`` for a 2-unit backward); idle time is ``.``.
    With several stages per rank, forwards of the rank's later stages print in lower case.

    Args:
        result: A simulation.
        width: Cap on the number of cells per row (longer rows are cut with ``>``).
    """
    durations = [t.end - t.start for row in result.timeline for t in row if t.end > t.start]
    unit = min(durations, default=1.0) / 2
    cells = round(result.makespan / unit) if unit > 0 else 0
    lines: list[str] = []
    for rank, row in enumerate(result.timeline):
        first_stage = min((t.action.stage for t in row), default=0)
        line = ["."] * cells
        for t in row:
            start, end = round(t.start / unit), round(t.end / unit)
            letter = t.action.kind.value
            if t.action.stage != first_stage:
                letter = letter.lower()
            label = f"{letter}{t.action.microbatch}"
            for i in range(start, end):
                offset = i - start
                line[i] = label[offset] if offset < len(label) else "-"
        text = "".join(line)
        if width is not None and len(text) > width:
            text = text[: max(width - 1, 0)] + ">"
        lines.append(f"r{rank} |{text}|")
    lines.append(
        f"bubble {result.bubble_fraction:.3f}, makespan {result.makespan:g}, "
        f"peak live activations {list(result.peak_live_activations)}"
    )
    return "\n".join(lines)


def draw_timeline_png(result: SimulatedTimeline, path: Path | str, *, title: str | None = None) -> Path:
    """Saves the timeline as a PNG (Gantt chart: ranks as rows, actions as labelled bars).

    Needs matplotlib (install ``d9d-pipeline[plot]``).

    Raises:
        ImportError: If matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("draw_timeline_png needs matplotlib: pip install 'd9d-pipeline[plot]'") from e
    n = len(result.timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, result.makespan * 0.35), 0.6 * n + 1.2))
    for rank, row in enumerate(result.timeline):
        for t in row:
            ax.barh(
                rank,
                t.end - t.start,
                left=t.start,
                color=_COLORS.get(t.action.kind, "grey"),
                edgecolor="black",
            )
            ax.text(
                (t.start + t.end) / 2,
                rank,
                f"{t.action.kind.value}{t.action.stage}.{t.action.microbatch}",
                ha="center",
                va="center",
                fontsize=6,
            )
    kinds = sorted({t.action.kind for row in result.timeline for t in row}, key=list(_COLORS).index)
    handles = [Patch(facecolor=_COLORS[k], edgecolor="black", label=k.name.lower()) for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble {result.bubble_fraction:.3f}")
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
