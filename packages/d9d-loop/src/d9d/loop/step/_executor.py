"""One step's work, from this rank's batch to the optimizer step, with its events around it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed import ProcessGroup
from torch.optim.lr_scheduler import LRScheduler

from d9d.loop._events import (
    EventBus,
    ForwardBackwardFinished,
    ForwardBackwardStarted,
    OptimizerStepStarted,
    StepStarted,
)
from d9d.loop._model_provider import FinalizeGradientsContext, ModelProvider, OptimizerSteppedContext
from d9d.loop._model_stage_factory import BuiltStage
from d9d.loop._providers import BatchSource, GradientScalingOptimizer
from d9d.loop._task import BuildForwardInputsContext, TrainTask
from d9d.loop.observability._run_instruments import RunInstruments
from d9d.loop.observability._step_metrics import StepEnd
from d9d.loop.step._figures import QueuedFigures, StepFigures
from d9d.loop.step._gradient_manager import GradientManager, all_reduce_sum_on_device
from d9d.loop.step._nonfinite_guard import NonFiniteGuard, StepVerdict
from d9d.loop.step._runner import StepRunner
from d9d.mesh import DistributedContext, map_tree

TreeT = TypeVar("TreeT")


def _to_device(tree: TreeT, device: torch.device) -> TreeT:
    """Moves every tensor of a batch tree to the job's device (pinned memory copies asynchronously)."""
    if device.type == "cpu":
        return tree  # batches are built on the host: nothing to move
    return map_tree(tree, lambda t, _path: t.to(device, non_blocking=True))


@dataclass(kw_only=True, frozen=True)
class ComputedStep:
    """A step whose forward and backward ran and whose gradients are not applied yet.

    Attributes:
        step: The step (optimizer steps done before it).
        sums: Reduced over the ranks, on the device: weighted loss, weight, microbatches, tokens,
            then the task's metric sums in the order of ``metric_names``.
        metric_names: The task's per-step metrics, sorted.
    """

    step: int
    sums: torch.Tensor
    metric_names: tuple[str, ...]


@dataclass(kw_only=True, frozen=True)
class StepInFlight:
    """A step whose work is queued and whose figures are not read yet.

    Attributes:
        figures: The step's sums and gradient norm on their way to the host.
        read_before: The figures, when the guard read them before the optimizer step (``skip``).
        verdict_before: The guard's verdict before the optimizer step (``APPLY`` when not read).
        learning_rate: The learning rate the optimizer stepped with.
        metric_names: The task's per-step metrics, in the order of the figures' metric sums.
        ended: The step's end as measured then, when its figures are read later.
    """

    figures: QueuedFigures
    read_before: StepFigures | None
    verdict_before: StepVerdict
    learning_rate: float
    metric_names: tuple[str, ...]
    ended: StepEnd | None = None


@dataclass(kw_only=True)
class StepExecutor:
    """Runs a step's work: batch, forward and backward, gradients, clipping, the optimizer step.

    It never waits for the device, except where the non-finite guard must see the loss and norm
    before the optimizer step (``skip``); the figures travel on in a ``StepInFlight`` for the
    ``StepReporter`` to read. ``wake`` brings a sleeping trainer back before the batch is built.
    """

    dist_context: DistributedContext
    provider: ModelProvider[Any]
    stages: Sequence[BuiltStage[Any]]
    task: TrainTask[Any, Any, Any, Any, Any]
    batches: BatchSource[Any]
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    gradients: GradientManager
    step_runner: StepRunner
    events: EventBus
    guard: NonFiniteGuard
    instruments: RunInstruments
    loss_group: ProcessGroup | None
    loss_replication: int
    microbatches_per_step: int
    wake: Callable[[int], None]

    def forward_backward(self, step: int) -> ComputedStep:
        """Starts ``step``: builds its inputs, runs forward and backward, reduces its sums."""
        self.instruments.step_started(step)
        self.events.publish(StepStarted(step=step))
        self.wake(step)  # a sleeping trainer wakes for its next step
        device = self.dist_context.device
        batch = _to_device(self.batches.next_batch(), device)
        built = self.task.build_forward_inputs(BuildForwardInputsContext(batch=batch, step=step))
        inputs, states, shared = (_to_device(t, device) for t in (built.input, built.state, built.shared))
        self.instruments.lap("data")
        self.events.publish(ForwardBackwardStarted(step=step))
        totals = self.step_runner.run(
            inputs=inputs,
            states=states,
            shared=shared,
            num_microbatches=self.microbatches_per_step,
            step=step,
        )
        # Only ranks that compute the loss count tokens, once per data-parallel replica.
        local_tokens = float(built.num_tokens or 0) if self.step_runner.has_last_stage else 0.0
        metric_names = tuple(sorted(totals.metric_sums))
        sums = all_reduce_sum_on_device(
            [
                totals.weighted_loss(device),
                totals.weight,
                float(totals.microbatches),
                local_tokens,
                *(totals.metric_sums[n] for n in metric_names),
            ],
            self.loss_group,
            device,
        )
        # Ranks of one tensor/context-parallel group report the same sums: count them once.
        sums = sums / self.loss_replication
        self.instruments.lap("forward_backward")
        # The weight stays on the device: the host reads the step's figures once, after the
        # optimizer's kernels are queued (before them only under `skip`, which must decide first).
        self.gradients.finish(global_weight=sums[1], microbatches_per_rank=self.microbatches_per_step)
        return ComputedStep(step=step, sums=sums, metric_names=metric_names)

    def drop(self) -> None:
        """Discards the gradients of a computed step that must not be applied."""
        self.optimizer.zero_grad(set_to_none=True)

    def apply(self, computed: ComputedStep) -> StepInFlight:
        """Finalizes and clips the gradients and steps the optimizer (unless the guard says not to)."""
        step = computed.step
        stages = [(s.stage, s.model) for s in self.stages]
        self.provider.finalize_gradients(
            FinalizeGradientsContext(dist_context=self.dist_context, stages=stages)
        )
        # An optimizer that scales gradients as it reads them gets the factor instead.
        scaling = self.optimizer if isinstance(self.optimizer, GradientScalingOptimizer) else None
        clip = self.gradients.clip(in_place=scaling is None)
        queued = QueuedFigures.queue(computed.sums, clip.norm, step)
        verdict = StepVerdict.APPLY
        read_before: StepFigures | None = None
        if self.guard.reads_norm_before_step:
            read_before = queued.read()
            self.events.publish(ForwardBackwardFinished(step=step, loss=read_before.loss))
            verdict = self.guard.check(step=step, loss=read_before.loss, grad_norm=read_before.grad_norm)
        self.events.publish(OptimizerStepStarted(step=step))
        learning_rate = float(self.optimizer.param_groups[0]["lr"])
        if verdict is StepVerdict.APPLY:
            if scaling is not None and clip.factor is not None:
                scaling.step_with_gradient_scale(clip.factor)
            else:
                self.optimizer.step()
            self.provider.optimizer_stepped(
                OptimizerSteppedContext(dist_context=self.dist_context, stages=stages, step=step)
            )
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepInFlight(
            figures=queued,
            read_before=read_before,
            verdict_before=verdict,
            learning_rate=learning_rate,
            metric_names=computed.metric_names,
        )
