"""``d9d plot``: a run's loss, learning rate and throughput from its JSONL metrics, as a picture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from d9d.loop._optional_import import import_extra
from d9d.loop.cli._errors import CommandError

PANELS = (("loss", ("loss", "eval/loss")), ("learning rate", ("lr",)), ("tokens / s", ("tokens_per_s",)))
"""Each panel's title and the metrics drawn in it (those a run logged)."""


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a JSONL metrics file (the ``jsonl`` tracker's), each with its ``step``.

    Raises:
        CommandError: If the file is missing, binary, empty, or a line is not a JSON object with a
            numeric ``step``, naming the file and line.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise CommandError(f"cannot read {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CommandError(f"{path} is not a text file (byte {e.start} is not UTF-8)") from e
    rows: list[dict[str, float]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise CommandError(f"{path}:{number}: not valid JSON: {e}") from e
        if not isinstance(raw, dict) or not isinstance(cast(dict[str, Any], raw).get("step"), int | float):
            raise CommandError(f"{path}:{number}: not a metrics row (a JSON object with a numeric 'step')")
        row = cast(dict[str, Any], raw)
        rows.append(
            {k: float(v) for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        )
    if not rows:
        raise CommandError(f"{path} holds no metrics rows")
    return rows


def plot_metrics(rows: list[dict[str, float]], output: Path, *, title: str) -> list[str]:
    """Draws each panel's metrics against the step into ``output``; returns the metrics drawn.

    Raises:
        CommandError: If the rows hold none of the panels' metrics.
    """
    panels = [(name, [m for m in metrics if any(m in r for r in rows)]) for name, metrics in PANELS]
    panels = [(name, metrics) for name, metrics in panels if metrics]
    if not panels:
        wanted = sorted({m for _, metrics in PANELS for m in metrics})
        raise CommandError(f"{title} holds none of the metrics {wanted}")
    import_extra("matplotlib", extra="plot", feature="d9d plot")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for axis, (name, metrics) in zip(axes[:, 0], panels, strict=True):
        for metric in metrics:
            points = [(r["step"], r[metric]) for r in rows if metric in r]
            axis.plot([p[0] for p in points], [p[1] for p in points], label=metric)
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
        if len(metrics) > 1:
            axis.legend()
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(title)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    pyplot.close(figure)
    return [m for _, metrics in panels for m in metrics]
