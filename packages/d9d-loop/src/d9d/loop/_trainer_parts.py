"""What a ``Trainer`` is made of (assembled by ``TrainingConfigurator``), and its own parts built from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.optim.lr_scheduler import LRScheduler

from d9d.loop._events import EventBus
from d9d.loop._model_provider import ModelProvider
from d9d.loop._model_stage_factory import BuiltStage
from d9d.loop._providers import BatchSource
from d9d.loop._sleep import TrainerSleeper, training_state_tensors
from d9d.loop._task import TrainTask
from d9d.loop.checkpoint._checkpointer import Checkpointer
from d9d.loop.checkpoint._resume_settings import capture_settings
from d9d.loop.checkpoint._run_contents import RunContents, data_source
from d9d.loop.checkpoint._run_state import RunState
from d9d.loop.config._run_plan import RunPlan
from d9d.loop.evaluation._evaluation import Evaluator
from d9d.loop.export._exporter import ModelExporter
from d9d.loop.metrics import MetricSet
from d9d.loop.observability._run_instruments import RunInstruments
from d9d.loop.observability._trackers import Tracker
from d9d.loop.step._executor import StepExecutor
from d9d.loop.step._gradient_manager import GradientManager
from d9d.loop.step._nonfinite_guard import NonFiniteGuard
from d9d.loop.step._reporter import StepReporter
from d9d.loop.step._runner import StepRunner
from d9d.mesh import DistributedContext


@dataclass(kw_only=True)
class TrainerParts:
    """The components a ``Trainer`` is made of; assembled by ``TrainingConfigurator``."""

    dist_context: DistributedContext
    plan: RunPlan
    provider: ModelProvider[Any]
    stages: Sequence[BuiltStage[Any]]
    task: TrainTask[Any, Any, Any, Any, Any]
    batches: BatchSource[Any]
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    gradients: GradientManager
    step_runner: StepRunner
    checkpointer: Checkpointer | None
    exporter: ModelExporter
    tracker: Tracker
    events: EventBus
    nonfinite_guard: NonFiniteGuard
    loss_group: ProcessGroup | None
    loss_replication: int
    owns_context: bool = False
    train_metrics: MetricSet | None = None  # the task's training metrics (None: it declares none)
    evaluator: Evaluator | None = None
    instruments: RunInstruments = field(default_factory=RunInstruments)


def build_run_state(parts: TrainerParts) -> RunState:
    """The run's checkpointed state over the parts; reads the configured settings first."""
    p, models = parts, [s.model for s in parts.stages]
    contents = RunContents(
        rank=p.dist_context.rank, plan=p.plan, models=models, optimizer=p.optimizer,
        lr_scheduler=p.lr_scheduler, batches=p.batches, task=p.task, tracker=p.tracker,
        evaluator=p.evaluator, train_metrics=p.train_metrics,
    )  # fmt: skip
    # What the config set, before any checkpoint restores its own values: on resume the config wins.
    configured = capture_settings(
        p.optimizer, p.lr_scheduler, total_steps=p.plan.total_steps,
        global_batch_size=p.plan.batch.global_batch_size, data_source=data_source(p.batches.state_dict()),
    )  # fmt: skip
    return RunState(
        contents=contents, configured=configured, dist_context=p.dist_context, plan=p.plan,
        checkpointer=p.checkpointer, models=models, optimizer=p.optimizer, lr_scheduler=p.lr_scheduler,
        tracker=p.tracker, train_metrics=p.train_metrics, instruments=p.instruments, events=p.events,
        guard=p.nonfinite_guard,
    )  # fmt: skip


def build_sleeper(parts: TrainerParts) -> TrainerSleeper:
    """What moves the training state to the host between steps and back."""
    models = [s.model for s in parts.stages]
    return TrainerSleeper(
        device=parts.dist_context.device,
        tensors=lambda: training_state_tensors(models, parts.optimizer),
        publish=parts.events.publish,
    )


def build_executor(parts: TrainerParts, *, wake: Callable[[int], None]) -> StepExecutor:
    """The step's work over the parts; ``wake`` brings a sleeping trainer back first."""
    p = parts
    return StepExecutor(
        dist_context=p.dist_context, provider=p.provider, stages=p.stages, task=p.task, batches=p.batches,
        optimizer=p.optimizer, lr_scheduler=p.lr_scheduler, gradients=p.gradients, step_runner=p.step_runner,
        events=p.events, guard=p.nonfinite_guard, instruments=p.instruments, loss_group=p.loss_group,
        loss_replication=p.loss_replication, microbatches_per_step=p.plan.batch.microbatches_per_step,
        wake=wake,
    )  # fmt: skip


def build_reporter(parts: TrainerParts, *, checkpoint_due: Callable[[int], bool]) -> StepReporter:
    """The step reporter over the parts; ``checkpoint_due`` says when a step must be read at its end."""
    p = parts
    return StepReporter(
        dist_context=p.dist_context, plan=p.plan, events=p.events, guard=p.nonfinite_guard,
        instruments=p.instruments, tracker=p.tracker, train_metrics=p.train_metrics,
        evaluator=p.evaluator, checkpoint_due=checkpoint_due,
    )  # fmt: skip
