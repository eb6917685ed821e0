"""A task's named metrics as one unit: synchronized, computed, flattened to floats, reset."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed import ProcessGroup

from d9d.loop.metrics._metric import Metric, MetricInputError, MetricValue


def _flatten(name: str, value: MetricValue) -> list[tuple[str, torch.Tensor]]:
    """``auroc`` -> ``auroc``; a dict -> ``name/key``; a per-class tensor -> ``name/0``, ``name/1``..."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return [(name, value.reshape(()))]
        return [(f"{name}/{i}", v) for i, v in enumerate(value.reshape(-1))]
    return [item for key, sub in value.items() for item in _flatten(f"{name}/{key}", sub)]


class MetricSet:
    """Named metrics of one purpose (training or evaluation) on this rank.

    Args:
        metrics: The task's metrics by name.
        contributes: Whether this rank's updates count. Ranks that do not hold the last pipeline
            stage, or repeat another rank's outputs (tensor/context-parallel peers), do not: their
            state is emptied before every synchronization so that each sample counts once.
    """

    def __init__(self, metrics: Mapping[str, Metric], *, contributes: bool) -> None:
        self._metrics = dict(metrics)
        self._contributes = contributes

    @property
    def metrics(self) -> Mapping[str, Metric]:
        """The metrics by name (what ``update_metrics`` receives)."""
        return self._metrics

    def __bool__(self) -> bool:
        return bool(self._metrics)

    def compute(self, group: ProcessGroup | None, *, prefix: str = "") -> dict[str, float]:
        """Synchronizes over ``group`` (collective), computes, resets; one host read for all values.

        Raises:
            MetricInputError: Naming the metric, when it counted bad inputs.
        """
        names: list[str] = []
        values: list[torch.Tensor] = []
        for name, metric in self._metrics.items():
            if not self._contributes:
                metric.reset()
            metric.sync(group)
            try:
                computed = metric.compute()
            except MetricInputError as e:
                raise MetricInputError(f"metric '{prefix}{name}': {e}") from e
            for flat_name, value in _flatten(prefix + name, computed):
                names.append(flat_name)
                values.append(
                    value.detach().to(torch.float64).cpu()
                    if value.device.type != "cpu"
                    else value.to(torch.float64)
                )
            metric.reset()
        if not values:
            return {}
        floats = cast(list[float], torch.stack(values).tolist())
        return dict(zip(names, floats, strict=True))

    def reset(self) -> None:
        """Empties every metric."""
        for metric in self._metrics.values():
            metric.reset()

    def state_dict(self) -> dict[str, Any]:
        """Every metric's local state by name."""
        return {name: metric.state_dict() for name, metric in self._metrics.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the metrics present in ``state`` (a metric added since starts empty)."""
        for name, metric in self._metrics.items():
            if name in state:
                metric.load_state_dict(state[name])
