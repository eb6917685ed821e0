"""Evaluation during training: a forward-only pass over held-out data, exact over all ranks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from d9d.loop._task import (
    BuildForwardInputsContext,
    ComputeLossContext,
    CreateMetricsContext,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop.config._evaluation import EvaluationConfig
from d9d.loop.data._evaluation_data import (
    EvaluationData,
    first_rows,
    padded_batches,
    real_rows_per_microbatch,
)
from d9d.loop.metrics import MetricSet
from d9d.loop.step._device_scalars import device_scalar
from d9d.loop.step._forward_runner import ForwardRunner
from d9d.mesh import DistributedContext, map_tree, shard_tree


def _to_device(tree: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return tree
    return map_tree(tree, lambda t, _path: t.to(device, non_blocking=True))


@dataclass(kw_only=True, frozen=True)
class EvaluationResult:
    """One evaluation's numbers (``eval/loss``, ``eval/<metric>``) and whether it is a new best."""

    metrics: dict[str, float]
    improved: bool


class Evaluator:
    """Runs the task's forward, loss and ``evaluation`` metrics over the held-out data.

    Each rank reads its share of every padded global batch (``padded_batches``); padding rows are
    cut from the outputs and state before ``compute_loss`` and ``update_metrics``, so each sample
    counts once whatever the layout. Loss sums and metrics are reduced over the world group, to
    which only ``contributes`` ranks add (the last stage, one rank per tensor/context-parallel
    group). The best result so far lives in ``best`` (saved with the trainer state).

    Args:
        config: When to evaluate and what the best is.
        runner: Forward-only runs of the model (plain or pipelined).
        task: The training task (its ``compute_loss`` and ``update_metrics``).
        data: The held-out data.
        dist_context: The job's distributed context.
        local_batch_size: Samples per rank and batch (the training layout's).
        num_microbatches: Microbatches per batch (the training layout's).
        total_steps: The run's length (for ``at_end``).
        contributes: Whether this rank's losses and metrics count.
    """

    def __init__(
        self,
        *,
        config: EvaluationConfig,
        runner: ForwardRunner,
        task: TrainTask[Any, Any, Any, Any, Any],
        data: EvaluationData[Any, Any],
        dist_context: DistributedContext,
        local_batch_size: int,
        num_microbatches: int,
        total_steps: int,
        contributes: bool,
    ) -> None:
        self._config = config
        self._runner = runner
        self._task = task
        self._data = data
        self._dataset = data.dataset_factory(dist_context)
        self._dist = dist_context
        self._local = local_batch_size
        self._microbatches = num_microbatches
        self._total_steps = total_steps
        self._contributes = contributes
        created = task.create_metrics(CreateMetricsContext(purpose="evaluation"))
        self._metrics = MetricSet(created.metrics, contributes=contributes)
        self.best: float | None = None

    def state_dict(self) -> dict[str, Any]:
        """The best result so far (the same on every rank; saved with the trainer state)."""
        return {"best": self.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the best result so far, so a resumed run checkpoints only real improvements."""
        best = state.get("best")
        self.best = None if best is None else float(best)

    def is_due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` optimizer steps."""
        return step % self._config.every_steps == 0 or (self._config.at_end and step == self._total_steps)

    def evaluate(self, *, step: int) -> EvaluationResult:
        """One pass over the held-out data (collective over all ranks)."""
        device = self._dist.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        weight_sum = torch.zeros((), dtype=torch.float64, device=device)
        for padded in padded_batches(
            self._data,
            self._dataset,
            local_batch_size=self._local,
            dp_rank=self._dist.data_parallel_rank,
            dp_size=self._dist.parameters.data_parallel,
        ):
            built = self._task.build_forward_inputs(
                BuildForwardInputsContext(batch=_to_device(padded.batch, device), step=step)
            )
            outputs = self._runner.forward(
                inputs=_to_device(built.input, device),
                shared=_to_device(built.shared, device),
                num_microbatches=self._microbatches,
            )
            if outputs is None or not self._contributes:
                continue
            states = shard_tree(_to_device(built.state, device), num_shards=self._microbatches)
            rows = real_rows_per_microbatch(
                padded.real, local_batch_size=self._local, num_microbatches=self._microbatches
            )
            with torch.no_grad():
                for index, (full_output, full_state, real) in enumerate(
                    zip(outputs, states, rows, strict=True)
                ):
                    if real == 0:
                        continue
                    output, state = first_rows(full_output, real), first_rows(full_state, real)
                    result = self._task.compute_loss(
                        ComputeLossContext(
                            pipeline_results=output, state=state, microbatch_index=index, step=step
                        )
                    )
                    weight = result.loss_weight if result.loss_weight is not None else float(real)
                    weight_t = device_scalar(weight, device=device, dtype=torch.float64)
                    loss_sum += result.loss.detach().to(torch.float64).reshape(()) * weight_t
                    weight_sum += weight_t
                    self._task.update_metrics(
                        UpdateMetricsContext(
                            pipeline_results=output,
                            state=state,
                            metrics=self._metrics.metrics,
                            purpose="evaluation",
                        )
                    )
        totals = torch.stack([loss_sum, weight_sum])
        group = self._dist.world_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
        loss, weight = float(totals[0]), float(totals[1])
        metrics = {"eval/loss": loss / weight if weight > 0 else math.nan}
        metrics |= self._metrics.compute(group, prefix="eval/")
        return EvaluationResult(metrics=metrics, improved=self._record_best(metrics))

    def _record_best(self, metrics: dict[str, float]) -> bool:
        best = self._config.best
        if best is None:
            return False
        if best.metric not in metrics:
            raise KeyError(
                f"trainer.evaluation.best.metric={best.metric!r} is not among the evaluation's "
                f"results {sorted(metrics)}"
            )
        value = metrics[best.metric]
        better = self.best is None or (value < self.best if best.mode == "min" else value > self.best)
        if better:
            self.best = value
        metrics[f"{best.metric}/best"] = self.best if self.best is not None else value
        return better and best.checkpoint
