"""The training loop: one object that runs steps, checkpoints, resumes and exports."""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup, broadcast_object_list
from torch.optim.lr_scheduler import LRScheduler

from d9d.loop._batch_layout import BatchLayout
from d9d.loop._events import (
    CheckpointSaved,
    EventBus,
    ForwardBackwardFinished,
    ForwardBackwardStarted,
    OptimizerStepFinished,
    OptimizerStepStarted,
    StepFinished,
    StepStarted,
    TrainingFinished,
)
from d9d.loop._model_provider import FinalizeGradientsContext, ModelProvider, OptimizerSteppedContext
from d9d.loop._model_stage_factory import BuiltStage
from d9d.loop._providers import BatchSource, DataError, GradientScalingOptimizer
from d9d.loop._sleep import TrainerSleeper, training_state_tensors
from d9d.loop._task import BuildForwardInputsContext, TrainTask
from d9d.loop.checkpoint._checkpointer import Checkpointer, CheckpointLocation
from d9d.loop.checkpoint._finite_weights import nonfinite_parameters
from d9d.loop.checkpoint._gate import CheckpointGate
from d9d.loop.checkpoint._manifest import RunLayout
from d9d.loop.checkpoint._resume import load_newest_usable, older_checkpoint_hint
from d9d.loop.checkpoint._resume_settings import capture_settings, reapply
from d9d.loop.checkpoint._rollback_walk import RollbackWalk
from d9d.loop.checkpoint._train_state import (
    ModelState,
    ObjectState,
    OptimizerState,
    RandomState,
    scheduler_state,
)
from d9d.loop.config._trainer import ResumeConfig
from d9d.loop.evaluation._evaluation import Evaluator
from d9d.loop.export._exporter import ModelExporter
from d9d.loop.export._target import ExportTargetError, check_replaceable
from d9d.loop.metrics import MetricSet
from d9d.loop.observability._progress import ProgressBar
from d9d.loop.observability._run_instruments import RunInstruments
from d9d.loop.observability._step_metrics import StepEnd, StepWork
from d9d.loop.observability._step_watchdog import StepWatchdog
from d9d.loop.observability._trackers import Tracker
from d9d.loop.step._figures import QueuedFigures, StepFigures
from d9d.loop.step._gradient_manager import GradientManager, all_reduce_sum_on_device
from d9d.loop.step._nonfinite_guard import NonFiniteError, NonFiniteGuard, StepVerdict
from d9d.loop.step._runner import StepRunner
from d9d.mesh import DistributedContext, map_tree

TreeT = TypeVar("TreeT")


def _to_device(tree: TreeT, device: torch.device) -> TreeT:
    """Moves every tensor of a batch tree to the job's device (pinned memory copies asynchronously)."""
    if device.type == "cpu":
        return tree  # batches are built on the host: nothing to move
    return map_tree(tree, lambda t, _path: t.to(device, non_blocking=True))


# How long a failing step waits for the previous step's figures before giving up on them.
_FAILURE_REPORT_WAIT_S = 30.0


def _data_source(state: object) -> str | None:
    """What a batch source's state names its data (its ``source``), None where it names none."""
    source = cast(dict[str, object], state).get("source") if isinstance(state, dict) else None
    return source if isinstance(source, str) else None


@dataclass(kw_only=True, frozen=True)
class _StepInFlight:
    """A step whose work is queued and whose figures are not read yet."""

    figures: QueuedFigures
    read_before: StepFigures | None  # read before the optimizer step (``skip``)
    verdict_before: StepVerdict
    learning_rate: float
    metric_names: tuple[str, ...]
    ended: StepEnd | None = None  # measured at the step's end when its figures are read later


class StepFailedError(RuntimeError):
    """A training step raised (a collective timeout, a bad batch, ...); names the step and rank."""


@dataclass(kw_only=True, frozen=True)
class RunPlan:
    """The plain values a ``Trainer`` runs by, read once from the config by the configurator.

    Attributes:
        total_steps: Optimizer steps of the whole run.
        batch: How each step's samples spread over ranks and microbatches.
        log_every_steps: Report metrics to the tracker every this many steps (and at the end).
        progress_bar: Show a progress bar on the main rank.
        checkpoint_every_steps: Save a checkpoint every this many steps (and at the end).
        resume: How to resume from the newest usable checkpoint; None: never resume.
        first_step_seconds: The step watchdog's allowance for the first step.
        step_seconds: The step watchdog's limit for later steps (None: no watchdog).
        checkpoint_trainable_only: Checkpoints hold only the parameters that train (LoRA).
        read_figures: When the host reads each step's figures (``trainer.logging.read_figures``).
    """

    total_steps: int
    batch: BatchLayout
    log_every_steps: int = 1
    progress_bar: bool = True
    checkpoint_every_steps: int = 100
    resume: ResumeConfig | None = None
    first_step_seconds: float | None = None
    step_seconds: float | None = None
    checkpoint_trainable_only: bool = False
    read_figures: Literal["after_step", "during_next_step"] = "after_step"


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


class Trainer:
    """Runs a configured job: ``train()`` resumes from the latest checkpoint and trains to the end.

    Per step: the task builds inputs from this rank's batch; the inputs are split into
    microbatches; forward and backward run over them (with the pipeline schedule when pipeline
    parallelism is on); loss weights are summed over ranks; gradients are synchronized by their
    placements, rescaled and clipped; the optimizer and LR scheduler step; metrics are reported;
    a checkpoint is saved when due.
    """

    def __init__(self, parts: TrainerParts) -> None:
        self._p = parts
        self._step = 0
        self._watchdog = StepWatchdog(rank=parts.dist_context.rank)
        self._guard = parts.nonfinite_guard
        self._rollback_due = False
        self._in_flight: _StepInFlight | None = None  # a step whose figures the next step reads
        self._reporting_late = False  # publishing a step's events in the middle of the next step
        self._evaluation_improved = False
        self._closed = False
        # What the config set, before any checkpoint restores its own values: on resume the config wins.
        self._configured = capture_settings(
            parts.optimizer,
            parts.lr_scheduler,
            total_steps=parts.plan.total_steps,
            global_batch_size=parts.plan.batch.global_batch_size,
            data_source=_data_source(parts.batches.state_dict()),
        )
        self._resumed_from: CheckpointLocation | None = None  # the checkpoint train() started from
        self._resume_tried = False  # resume() ran (train() then does not load a second time)
        self._saved_total_steps: int | None = None
        self._saved_global_batch: int | None = None
        self._saved_data_source: str | None = None
        self._rollback_walk = RollbackWalk()
        self._gate = CheckpointGate(
            guard=parts.nonfinite_guard,
            nonfinite_weights=self._nonfinite_weights,
            logger=parts.dist_context.logger,
            is_main_process=parts.dist_context.is_main_process,
        )
        self._sleeper = TrainerSleeper(
            device=parts.dist_context.device,
            tensors=lambda: training_state_tensors(self.model_stages, parts.optimizer),
            publish=parts.events.publish,
        )
        # A trainer that owns its context releases it at interpreter exit if never closed, so
        # ``export()`` after ``train()`` still works in scripts that never call ``close()``.
        if parts.owns_context:
            atexit.register(self.close)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dist_context(self) -> DistributedContext:
        """The job's distributed context."""
        return self._p.dist_context

    @property
    def events(self) -> EventBus:
        """Subscribe here to the run's typed events."""
        return self._p.events

    @property
    def model_stages(self) -> list[nn.Module]:
        """The model stages held by this rank."""
        return [s.model for s in self._p.stages]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over all local stages."""
        return self._p.optimizer

    @property
    def step(self) -> int:
        """Optimizer steps completed so far."""
        return self._step

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return self._p.plan.total_steps

    @property
    def is_asleep(self) -> bool:
        """Whether ``sleep()`` moved the training state to the host."""
        return self._sleeper.is_asleep

    def sleep(self) -> None:
        """Between steps: moves parameters, gradients, buffers and optimizer state to host memory.

        Pinned host memory on CUDA, and the allocator's cache is emptied, so a colocated rollout
        engine can use the accelerator. Fires ``SleepStarted`` / ``SleepFinished``. Every tensor
        object stays valid (only its storage moves); the next step, or ``wake()``, brings the
        state back bit-exact. No-op when asleep.

        Raises:
            RuntimeError: If called from an event of a step whose figures are read during the
                next step (``trainer.logging.read_figures: during_next_step``): that step's work
                is queued then.
        """
        if self._reporting_late:
            raise RuntimeError(
                "sleep() was called during step "
                f"{self._step} (from an event of step {self._step - 1}, whose figures are read during "
                "the next step under trainer.logging.read_figures=during_next_step); call it between steps"
            )
        self._sleeper.sleep(self._step)

    def wake(self) -> None:
        """Brings the state ``sleep()`` moved back to the device, bit-exact; no-op when awake.

        Fires ``WakeStarted`` / ``WakeFinished``.
        """
        self._sleeper.wake(self._step)

    def _checkpoint_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        p = self._p
        state: dict[str, Any] = {
            "model": ModelState(self.model_stages, trainable_only=p.plan.checkpoint_trainable_only),
            "optimizer": OptimizerState(self.model_stages, p.optimizer),
            "trainer": ObjectState(self._trainer_state, self._load_trainer_state),
            f"rng_rank{p.dist_context.rank}": RandomState(),
        }
        if p.train_metrics:
            # Each rank's partial window (the updates since the last logged step) differs: one key per rank.
            state[self._metrics_key()] = ObjectState(self._metrics_state, self._load_metrics_state)
        if not with_optimizer:
            del state["optimizer"]
        return state

    def _layout(self) -> RunLayout:
        return RunLayout(
            global_batch_size=self._p.plan.batch.global_batch_size, optimizer=type(self._p.optimizer).__name__
        )

    def _metrics_key(self) -> str:
        return f"train_metrics_rank{self._p.dist_context.rank}"

    def _metrics_state(self) -> dict[str, Any]:
        assert self._p.train_metrics is not None
        state = self._p.train_metrics.state_dict()
        return {name: {k: v.detach().cpu() for k, v in sums.items()} for name, sums in state.items()}

    def _load_metrics_state(self, state: dict[str, Any]) -> None:
        assert self._p.train_metrics is not None
        self._p.train_metrics.load_state_dict(state)

    def _trainer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self._step,
            "total_steps": self._p.plan.total_steps,
            "data": self._p.batches.state_dict(),
            "lr_scheduler": scheduler_state(self._p.lr_scheduler),
            "task": self._p.task.state_dict(),
            "tracker": self._p.tracker.state_dict(),
        }
        if self._p.evaluator is not None:
            state["evaluation"] = self._p.evaluator.state_dict()
        return state

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])
        saved_total: object = state.get("total_steps")  # absent in checkpoints of older d9d
        self._saved_total_steps = saved_total if isinstance(saved_total, int) else None
        data: object = state["data"]
        saved_global = (
            cast(dict[str, object], data).get("global_batch_size") if isinstance(data, dict) else None
        )
        self._saved_global_batch = saved_global if isinstance(saved_global, int) else None
        self._saved_data_source = _data_source(state["data"])
        self._p.batches.load_state_dict(state["data"])
        scheduler = self._p.lr_scheduler
        scheduler.load_state_dict({**scheduler.state_dict(), **state["lr_scheduler"]})
        self._p.task.load_state_dict(state["task"])
        self._p.tracker.load_state_dict(state["tracker"])
        if self._p.evaluator is not None:
            # A checkpoint from before evaluation was configured has no best yet: none so far.
            self._p.evaluator.load_state_dict(state.get("evaluation", {}))

    def _nonfinite_weights(self) -> list[str]:
        return nonfinite_parameters(self.model_stages, self._p.dist_context.world_group())

    def resume(self) -> CheckpointLocation | None:
        """Loads the newest usable checkpoint (verified, else the next older) if resume is on.

        A checkpoint is usable when its files match its manifest, it loads, and its weights are
        finite; a newer unusable one is set aside as ``step_N.damaged``. With
        ``resume.from_step`` only that step's checkpoint is loaded and the newer ones are set
        aside as ``step_N.superseded``.
        """
        options = self._p.plan.resume
        from_step = options.from_step if options is not None else None
        self._resumed_from = self._resume(older_than=None, from_step=from_step)
        self._resume_tried = True
        return self._resumed_from

    def _resume(self, *, older_than: int | None, from_step: int | None = None) -> CheckpointLocation | None:
        checkpointer = self._p.checkpointer
        options = self._p.plan.resume
        if checkpointer is None or options is None:
            return None
        resumed = load_newest_usable(
            checkpointer,
            state=self._checkpoint_state,
            optional=(f"rng_rank{self._p.dist_context.rank}", self._metrics_key()),
            layout=self._layout(),
            options=options,
            logger=self._p.dist_context.logger,
            nonfinite_weights=self._nonfinite_weights,
            older_than=older_than,
            from_step=from_step,
        )
        if resumed is None:
            return None
        location, absent = resumed.location, resumed.absent
        if f"rng_rank{self._p.dist_context.rank}" in absent:
            # The checkpoint was written by fewer ranks (resharded resume): this rank keeps its seed.
            self._p.dist_context.logger.warning(
                "%s has no random state for this rank; keeping the seeded one", location.path
            )
        if self._p.train_metrics and self._metrics_key() in absent:
            # Fewer ranks, or a checkpoint from before metrics were saved: this rank's window starts empty.
            self._p.train_metrics.reset()
        changed = resumed.cast + reapply(
            self._configured,
            optimizer=self._p.optimizer,
            scheduler=self._p.lr_scheduler,
            saved_total_steps=self._saved_total_steps,
            saved_global_batch_size=self._saved_global_batch,
            saved_data_source=self._saved_data_source,
        )
        if self._p.dist_context.is_main_process:
            for line in changed:
                self._p.dist_context.logger.warning(
                    "resuming from %s, the config wins: %s", location.path, line
                )
            self._p.tracker.on_resume(self._step)
        self._p.instruments.resumed()
        self._p.dist_context.logger.info("resumed from %s at step %d", location.path, self._step)
        return location

    def train(self) -> None:
        """Trains until the configured number of steps, resuming first when possible.

        A job that called ``resume()`` itself (to look at the resumed step first) is not loaded a
        second time.
        """
        p = self._p
        resumed = self._resumed_from if self._resume_tried else self.resume()
        if resumed is not None:
            self._check_steps_left(resumed)
        bar = ProgressBar(
            total=p.plan.total_steps,
            initial=self._step,
            enabled=p.plan.progress_bar and p.dist_context.is_main_process,
        )
        first = True
        try:
            while self._step < p.plan.total_steps:
                self._watchdog.arm(self._step, p.plan.first_step_seconds if first else p.plan.step_seconds)
                try:
                    reported = self._train_step()
                except NonFiniteError as e:
                    hint = self._older_checkpoint_hint()
                    if not hint:
                        raise  # names the step already
                    raise NonFiniteError(f"{e}; {hint}") from e
                except DataError:
                    self._report_before_failing()
                    raise  # names the file and line: the data's fault, not the step's
                except Exception as e:
                    self._report_before_failing()
                    # e.g. a collective that timed out: say where, then let the job end
                    raise StepFailedError(
                        f"step {self._step} failed on rank {p.dist_context.rank}: {type(e).__name__}: {e}"
                    ) from e
                self._watchdog.disarm()
                first = False
                if self._rollback_due:
                    self._rollback()  # before anything of the non-finite state is saved
                    continue
                for metrics in reported:
                    bar.update(metrics)
                self._maybe_checkpoint(final=self._step == p.plan.total_steps or self._evaluation_improved)
            if p.checkpointer is not None:
                p.checkpointer.finalize(self._on_checkpoint_visible)
            p.events.publish(TrainingFinished(steps=self._step))
        finally:
            self._watchdog.disarm()
            bar.close()
            p.tracker.close()
            p.instruments.close()

    def _check_steps_left(self, resumed: CheckpointLocation) -> None:
        """Says that a resumed run has nothing to train, or refuses one resumed past its end."""
        total = self._p.plan.total_steps
        if self._step > total:
            raise ValueError(
                f"resumed from {resumed.path} at step {self._step}, past this run's {total} steps "
                "(trainer.max_steps / epochs): nothing would be trained. Raise max_steps, resume from "
                "an older checkpoint (trainer.checkpoint.resume: {from_step: N}) or use another "
                "trainer.checkpoint.directory"
            )
        if self._step == total and self._p.dist_context.is_main_process:
            self._p.dist_context.logger.warning(
                "already finished at step %d (resumed from %s): nothing to train", self._step, resumed.path
            )

    def _older_checkpoint_hint(self) -> str:
        """Names the checkpoint the run resumed from and how to resume from an older one."""
        checkpointer = self._p.checkpointer
        if checkpointer is None:
            return ""
        return older_checkpoint_hint(self._resumed_from, checkpointer.on_disk())

    def _maybe_checkpoint(self, *, final: bool) -> None:
        p = self._p
        if p.checkpointer is None:
            return
        due = final or self._checkpoint_due(self._step)
        if self._gate.should_save(step=self._step, due=due):
            p.checkpointer.save(
                self._step, self._checkpoint_state(), self._on_checkpoint_visible, layout=self._layout()
            )
        else:
            p.checkpointer.finalize(self._on_checkpoint_visible)

    def _rollback(self) -> None:
        self._rollback_due = False
        if self._p.checkpointer is not None:
            self._p.checkpointer.finalize(self._on_checkpoint_visible)
        failed_step = self._step
        older_than = self._rollback_walk.older_than(failed_step)
        location = self._resume(older_than=older_than)
        if location is None and older_than is not None:
            raise NonFiniteError(
                f"step {failed_step - 1} was not finite again after rolling back to the checkpoint of "
                f"step {older_than}, and there is no older checkpoint to roll back to"
            )
        if location is None:
            raise NonFiniteError(
                f"step {failed_step - 1} was not finite and there is no checkpoint to roll back to "
                f"(trainer.nonfinite.policy=rollback needs trainer.checkpoint.directory)"
            )
        self._rollback_walk.moved(failed_step=failed_step, checkpoint_step=location.step)
        if self._p.dist_context.is_main_process:
            self._p.dist_context.logger.warning(
                "step %d was not finite: rolled back to %s", failed_step - 1, location.path
            )

    def _on_checkpoint_visible(self, location: CheckpointLocation) -> None:
        self._p.events.publish(CheckpointSaved(step=location.step, path=location.path))

    def _train_step(self) -> list[dict[str, float]]:
        """Runs one step; returns the metrics of the steps whose figures it read (0, 1 or 2)."""
        p = self._p
        step = self._step
        p.instruments.step_started(step)
        p.events.publish(StepStarted(step=step))
        self._sleeper.wake(step)  # a sleeping trainer wakes for its next step
        batch = _to_device(p.batches.next_batch(), p.dist_context.device)
        built = p.task.build_forward_inputs(BuildForwardInputsContext(batch=batch, step=step))
        built_input = _to_device(built.input, p.dist_context.device)
        built_state = _to_device(built.state, p.dist_context.device)
        built_shared = _to_device(built.shared, p.dist_context.device)
        p.instruments.lap("data")
        p.events.publish(ForwardBackwardStarted(step=step))
        totals = p.step_runner.run(
            inputs=built_input,
            states=built_state,
            shared=built_shared,
            num_microbatches=p.plan.batch.microbatches_per_step,
            step=step,
        )
        # Only ranks that compute the loss count tokens, once per data-parallel replica.
        local_tokens = float(built.num_tokens or 0) if p.step_runner.has_last_stage else 0.0
        metric_names = tuple(sorted(totals.metric_sums))
        sums = all_reduce_sum_on_device(
            [
                totals.weighted_loss(p.dist_context.device),
                totals.weight,
                float(totals.microbatches),
                local_tokens,
                *(totals.metric_sums[n] for n in metric_names),
            ],
            p.loss_group,
            p.dist_context.device,
        )
        # Ranks of one tensor/context-parallel group report the same sums: count them once.
        sums = sums / p.loss_replication
        p.instruments.lap("forward_backward")

        # The weight stays on the device: the host reads the step's figures once, after the
        # optimizer's kernels are queued (before them only under `skip`, which must decide first).
        p.gradients.finish(global_weight=sums[1], microbatches_per_rank=p.plan.batch.microbatches_per_step)
        reported: list[dict[str, float]] = []
        if self._in_flight is not None:
            # The previous step's figures, read now that this step's work keeps the device busy.
            self._reporting_late = True
            try:
                reported.append(self._report(self._in_flight))
            finally:
                self._reporting_late = False
                self._in_flight = None
            if self._rollback_due:
                # The previous step was not finite: this one is dropped; the rollback restores
                # the data position, the metrics and the state from before the bad step.
                p.optimizer.zero_grad(set_to_none=True)
                return reported

        p.provider.finalize_gradients(
            FinalizeGradientsContext(
                dist_context=p.dist_context, stages=[(s.stage, s.model) for s in p.stages]
            )
        )
        # An optimizer that scales gradients as it reads them gets the factor instead.
        scaling = p.optimizer if isinstance(p.optimizer, GradientScalingOptimizer) else None
        clip = p.gradients.clip(in_place=scaling is None)
        queued = QueuedFigures.queue(sums, clip.norm, step)
        verdict = StepVerdict.APPLY
        read_before: StepFigures | None = None
        if self._guard.reads_norm_before_step:
            read_before = queued.read()
            p.events.publish(ForwardBackwardFinished(step=step, loss=read_before.loss))
            verdict = self._guard.check(step=step, loss=read_before.loss, grad_norm=read_before.grad_norm)
        p.events.publish(OptimizerStepStarted(step=step))
        learning_rate = float(p.optimizer.param_groups[0]["lr"])
        if verdict is StepVerdict.APPLY:
            if scaling is not None and clip.factor is not None:
                scaling.step_with_gradient_scale(clip.factor)
            else:
                p.optimizer.step()
            p.provider.optimizer_stepped(
                OptimizerSteppedContext(
                    dist_context=p.dist_context, stages=[(s.stage, s.model) for s in p.stages], step=step
                )
            )
        p.lr_scheduler.step()
        p.optimizer.zero_grad(set_to_none=True)
        self._step += 1
        in_flight = _StepInFlight(
            figures=queued,
            read_before=read_before,
            verdict_before=verdict,
            learning_rate=learning_rate,
            metric_names=metric_names,
        )
        if self._reads_at_end(step):
            reported.append(self._report(in_flight))  # the step's time includes the wait
        else:
            self._in_flight = replace(in_flight, ended=self._end_step(step))
        return reported

    def _end_step(self, step: int) -> StepEnd:
        self._p.instruments.lap("optimizer")
        return self._p.instruments.step_finished(step)

    def _report_before_failing(self) -> None:
        """Reports the step whose figures were still in flight when the next step failed.

        Its loss and metrics are often what explains the failure. The device may never finish
        (a hung collective), so the wait is bounded, and an error of the report itself is logged
        without replacing the step's own.
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None or not in_flight.figures.wait(_FAILURE_REPORT_WAIT_S):
            return
        try:
            self._report(in_flight)
        except Exception as e:
            self._p.dist_context.logger.warning(
                "step %d's figures could not be reported after step %d failed: %s: %s",
                in_flight.figures.step, self._step, type(e).__name__, e,
            )  # fmt: skip

    def _reads_at_end(self, step: int) -> bool:
        """Whether ``step``'s figures are read at its end rather than during the next step."""
        p = self._p
        match p.plan.read_figures:
            case "after_step":
                return True
            case "during_next_step":
                done = step + 1
                checkpoint_due = p.checkpointer is not None and self._checkpoint_due(done)
                evaluation_due = p.evaluator is not None and p.evaluator.is_due(done)
                metrics_logged = p.train_metrics is not None and self._logged(step)
                return done == p.plan.total_steps or checkpoint_due or evaluation_due or metrics_logged

    def _checkpoint_due(self, done: int) -> bool:
        """Whether the checkpoint interval falls after ``done`` finished steps."""
        return done % self._p.plan.checkpoint_every_steps == 0

    def _logged(self, step: int) -> bool:
        return step % self._p.plan.log_every_steps == 0 or step + 1 == self._p.plan.total_steps

    def _report(self, in_flight: _StepInFlight) -> dict[str, float]:
        """Reads a step's figures, checks them, publishes its events and logs its metrics."""
        p = self._p
        step = in_flight.figures.step
        verdict = in_flight.verdict_before
        figures_read = in_flight.read_before
        if figures_read is None:
            figures_read = in_flight.figures.read()
            p.events.publish(ForwardBackwardFinished(step=step, loss=figures_read.loss))
            # A step that was not finite already went through the optimizer here: `stop` ends the
            # run and `rollback` reloads a checkpoint, so no state after it is ever saved.
            verdict = self._guard.check(step=step, loss=figures_read.loss, grad_norm=figures_read.grad_norm)
        loss, grad_norm, tokens = figures_read.loss, figures_read.grad_norm, figures_read.tokens
        ended = in_flight.ended if in_flight.ended is not None else self._end_step(step)
        self._rollback_due = verdict is StepVerdict.ROLLBACK
        p.events.publish(
            OptimizerStepFinished(step=step, learning_rate=in_flight.learning_rate, grad_norm=grad_norm)
        )
        figures = p.instruments.figures(
            ended, StepWork(samples=p.plan.batch.global_batch_size, tokens=tokens)
        )
        metrics: dict[str, float] = {"loss": loss, "lr": in_flight.learning_rate, "grad_norm": grad_norm}
        if verdict is StepVerdict.SKIP:
            metrics["skipped"] = 1.0
        metrics |= figures  # throughput (smoothed), step-time split, MFU, memory
        for name, value in zip(in_flight.metric_names, figures_read.metric_sums, strict=True):
            metrics[name] = value / figures_read.microbatches
        logged = self._logged(step)
        if p.train_metrics is not None and logged:  # collective: every rank logs the same steps
            metrics |= p.train_metrics.compute(p.dist_context.world_group())
        self._evaluation_improved = False
        if p.evaluator is not None and p.evaluator.is_due(step + 1):
            evaluation = p.evaluator.evaluate(step=step + 1)
            metrics |= evaluation.metrics
            self._evaluation_improved, logged = evaluation.improved, True
        if p.dist_context.is_main_process and logged:
            p.tracker.log(step, metrics)
        p.events.publish(StepFinished(step=step, metrics=metrics))
        return metrics

    def export(self, path: str | Path, *, overwrite: bool = False, replace_other: bool = False) -> Path:
        """Writes the model as one safetensors directory through the provider's export mapper.

        Collective over all ranks; works under every layout, pipeline parallelism included (see
        ``ModelExporter``).

        Args:
            path: The target directory.
            overwrite: Replace a previous d9d export at ``path`` (it stays intact if the export
                fails). A directory holding files no d9d export wrote is refused, naming them.
            replace_other: With ``overwrite``, replace such a directory too (its files are lost).

        Returns:
            The target directory.

        Raises:
            ExportTargetError: On every rank, before any work, if ``overwrite`` would delete
                files d9d did not write and ``replace_other`` is False.
        """
        if overwrite and not replace_other:
            problem: str | None = None
            if self._p.dist_context.is_main_process:
                try:
                    check_replaceable(path)
                except ExportTargetError as e:
                    problem = str(e)
            verdict: list[str | None] = [problem]
            broadcast_object_list(verdict, src=0, group=self._p.dist_context.world_group())
            if verdict[0] is not None:
                raise ExportTargetError(verdict[0])
        return self._p.exporter.export(path, overwrite=overwrite)

    def close(self) -> None:
        """Releases the trainer (idempotent): gradient hooks, the checkpoint lock, an owned context.

        The checkpoint directory's lock is released so that another job may use the directory.

        The trainer owns the context when ``TrainingConfigurator`` created it (built from
        ``mesh=MeshParameters``); a context the user passed in is left to the user.
        """
        if self._closed:
            return
        self._closed = True
        self._p.gradients.close()
        if self._p.checkpointer is not None:
            self._p.checkpointer.close()  # another job may use the directory now
        if self._p.owns_context:
            atexit.unregister(self.close)
            self._p.dist_context.close()
