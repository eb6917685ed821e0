"""The configured learning-rate schedule as a picture, before a run is launched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter
from torch.optim.lr_scheduler import LambdaLR

from d9d.loop._lr_schedule import PiecewiseSchedule
from d9d.loop._optional_import import import_extra
from d9d.loop.config._lr import ConstantLRSchedulerConfig, LRSchedulerConfig, PiecewiseLRSchedulerConfig
from d9d.loop.config._optimizer import OptimizerConfig


def lr_schedule_values(raw: dict[str, Any], *, steps: int | None = None) -> list[float]:
    """The learning rate of every optimizer step of the run a config describes.

    Only the ``trainer.max_steps``, ``optimizer`` and ``lr_scheduler`` sections are read, so a
    config with a user's own sections works too. The values are what ``LambdaLR`` over the
    configured schedule gives, stepped once per optimizer step as the trainer does.

    Args:
        raw: The config file's contents.
        steps: The run length (needed when the run is given in ``epochs``).
    """
    trainer: dict[str, Any] = raw.get("trainer", {})
    total = steps or trainer.get("max_steps")
    if total is None:
        raise ValueError("the run length is given in epochs: pass the number of steps (--steps)")
    optimizer_config: OptimizerConfig = TypeAdapter(OptimizerConfig).validate_python(
        raw.get("optimizer", {"name": "adamw"})
    )
    schedule: LRSchedulerConfig = TypeAdapter(LRSchedulerConfig).validate_python(
        raw.get("lr_scheduler", {"name": "constant"})
    )
    parameter = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([parameter], lr=optimizer_config.lr)
    match schedule:
        case PiecewiseLRSchedulerConfig():
            schedule.check_run_length(total)
            scheduler = LambdaLR(optimizer, PiecewiseSchedule(schedule, total))
        case ConstantLRSchedulerConfig():
            scheduler = LambdaLR(optimizer, lambda step: 1.0)
    values: list[float] = []
    for _ in range(total):
        values.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return values


def plot_lr_schedule(values: list[float], output: Path, *, title: str) -> Any:
    """Draws ``values`` against the step into ``output`` (PNG, SVG, PDF by suffix); returns the figure."""
    import_extra("matplotlib", extra="plot", feature="d9d lr-plot")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 3.5))
    axes.plot(range(len(values)), values)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("learning rate")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    pyplot.close(figure)
    return figure
