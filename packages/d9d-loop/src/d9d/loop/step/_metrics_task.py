"""Feeds a task's training metrics from the loss computation, without touching the step runners."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from d9d.loop._task import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop.metrics import MetricSet


class MetricsUpdatingTask(TrainTask[Any, Any, Any, Any, Any]):
    """The user's task, whose ``compute_loss`` also adds the microbatch to the training metrics.

    The step runners call ``compute_loss`` once per microbatch on the last pipeline stage, which
    is exactly where and when ``update_metrics`` must run; the outputs reach it under
    ``torch.no_grad`` so metric updates never join the backward graph.
    """

    def __init__(self, task: TrainTask[Any, Any, Any, Any, Any], metrics: MetricSet) -> None:
        self._task = task
        self._metrics = metrics

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[Any]
    ) -> BuildForwardInputsResult[Any, Any, Any]:
        return self._task.build_forward_inputs(ctx)

    def compute_loss(self, ctx: ComputeLossContext[Any, Any]) -> ComputeLossResult:
        result = self._task.compute_loss(ctx)
        with torch.no_grad():
            self._task.update_metrics(
                UpdateMetricsContext(
                    pipeline_results=ctx.pipeline_results,
                    state=ctx.state,
                    metrics=self._metrics.metrics,
                    purpose="train",
                )
            )
        return result

    def state_dict(self) -> dict[str, Any]:
        return self._task.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._task.load_state_dict(state)
