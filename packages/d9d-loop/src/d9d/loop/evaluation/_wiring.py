"""Wires a task's metrics and the evaluation pass into a job (called by the configurator)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from d9d.loop._batch_layout import BatchLayout
from d9d.loop._model_stage_factory import BuiltStage
from d9d.loop._task import CreateMetricsContext, TrainTask
from d9d.loop.config._evaluation import EvaluationConfig
from d9d.loop.data._evaluation_data import EvaluationData
from d9d.loop.evaluation._evaluation import Evaluator
from d9d.loop.metrics import MetricSet
from d9d.loop.step._forward_runner import ForwardRunner, PipelinedForwardRunner, SequentialForwardRunner
from d9d.loop.step._metrics_task import MetricsUpdatingTask
from d9d.mesh import DistributedContext
from d9d.pipeline import PipelineProgram


@dataclass(kw_only=True, frozen=True)
class MetricsWiring:
    """What the trainer gets: the task its step runner calls, training metrics, the evaluator."""

    step_task: TrainTask[Any, Any, Any, Any, Any]
    train_metrics: MetricSet | None
    evaluator: Evaluator | None


def counts_metrics(dist_context: DistributedContext, stages: Sequence[BuiltStage[Any]]) -> bool:
    """Whether this rank's losses and metrics count: it holds the last stage, and is the first
    rank of its tensor/context-parallel group (whose ranks all see the same outputs)."""
    mesh = dist_context.parameters
    last = any(s.stage.current_stage == s.stage.num_stages - 1 for s in stages)
    return last and dist_context.rank % (mesh.tensor_parallel * mesh.context_parallel) == 0


def forward_runner(
    dist_context: DistributedContext, program: PipelineProgram | None, stages: Sequence[BuiltStage[Any]]
) -> ForwardRunner:
    """A plain forward runner, or one over the pipeline program's forwards."""
    if program is None:
        return SequentialForwardRunner(stages[0].model)
    return PipelinedForwardRunner(program=program, stages=stages, dist_context=dist_context)


def wire_metrics(
    *,
    task: TrainTask[Any, Any, Any, Any, Any],
    config: EvaluationConfig | None,
    data: EvaluationData[Any, Any] | None,
    dist_context: DistributedContext,
    program: PipelineProgram | None,
    stages: Sequence[BuiltStage[Any]],
    layout: BatchLayout,
    total_steps: int,
) -> MetricsWiring:
    """Wraps the task when it declares training metrics; builds the evaluator when configured."""
    contributes = counts_metrics(dist_context, stages)
    created = task.create_metrics(CreateMetricsContext(purpose="train")).metrics
    train_metrics = MetricSet(created, contributes=contributes) if created else None
    evaluator = None
    if config is not None:
        if data is None:
            raise ValueError("trainer.evaluation is set but TrainingConfigurator got no evaluation_data=")
        evaluator = Evaluator(
            config=config,
            runner=forward_runner(dist_context, program, stages),
            task=task,
            data=data,
            dist_context=dist_context,
            local_batch_size=layout.local_batch_size,
            num_microbatches=layout.microbatches_per_step,
            total_steps=total_steps,
            contributes=contributes,
        )
    return MetricsWiring(
        step_task=MetricsUpdatingTask(task, train_metrics) if train_metrics is not None else task,
        train_metrics=train_metrics,
        evaluator=evaluator,
    )
