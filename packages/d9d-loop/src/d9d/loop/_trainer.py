"""The training loop: a ``StepExecutor`` does each step's work, a ``StepReporter`` reads and reports
the step in flight and returns its verdict, a ``RunState`` saves, resumes and rolls back."""

from __future__ import annotations

import atexit
from pathlib import Path

import torch
from torch import nn
from torch.distributed import broadcast_object_list

from d9d.loop._events import EventBus, TrainingFinished
from d9d.loop._providers import DataError
from d9d.loop._trainer_parts import (
    TrainerParts,
    build_executor,
    build_reporter,
    build_run_state,
    build_sleeper,
)
from d9d.loop.checkpoint._checkpointer import CheckpointLocation
from d9d.loop.config._run_plan import RunPlan
from d9d.loop.export._target import ExportTargetError, check_replaceable
from d9d.loop.observability._step_watchdog import StepWatchdog
from d9d.loop.step._nonfinite_guard import NonFiniteError
from d9d.loop.step._reporter import StepReport
from d9d.mesh import DistributedContext

__all__ = ["RunPlan", "StepFailedError", "Trainer", "TrainerParts"]  # the configurator imports them here


class StepFailedError(RuntimeError):
    """A training step raised (a collective timeout, a bad batch, ...); names the step and rank."""


class Trainer:
    """Runs a configured job: ``train()`` resumes from the latest checkpoint and trains to the end.

    Per step: the task builds inputs from this rank's batch; the inputs are split into
    microbatches; forward and backward run over them (with the pipeline schedule when pipeline
    parallelism is on); loss weights are summed over ranks; gradients are synchronized by their
    placements, rescaled and clipped; the optimizer and LR scheduler step; metrics are reported;
    a checkpoint is saved when due.
    """

    def __init__(self, parts: TrainerParts) -> None:
        p = self._p = parts
        self._closed = False
        self._watchdog = StepWatchdog(rank=p.dist_context.rank)
        self._run = build_run_state(p)
        self._sleeper = build_sleeper(p)
        self._executor = build_executor(p, wake=self._sleeper.wake)
        self._reporter = build_reporter(p, checkpoint_due=self._run.checkpoint_due)
        # A trainer that owns its context releases it at interpreter exit if never closed, so
        # ``export()`` after ``train()`` still works in scripts that never call ``close()``.
        if p.owns_context:
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
        return self._run.step

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
        self._reporter.refuse_while_late("sleep()", step=self._run.step)
        self._sleeper.sleep(self._run.step)

    def wake(self) -> None:
        """Brings the state ``sleep()`` moved back to the device, bit-exact; no-op when awake.

        Fires ``WakeStarted`` / ``WakeFinished``.
        """
        self._sleeper.wake(self._run.step)

    def resume(self) -> CheckpointLocation | None:
        """Loads the newest usable checkpoint (verified, else the next older) if resume is on.

        A checkpoint is usable when its files match its manifest, it loads, and its weights are
        finite; a newer unusable one is set aside as ``step_N.damaged``. With
        ``resume.from_step`` only that step's checkpoint is loaded and the newer ones are set
        aside as ``step_N.superseded``.
        """
        return self._run.resume()

    def train(self) -> None:
        """Trains until the configured number of steps, resuming first when possible.

        A job that called ``resume()`` itself (to look at the resumed step first) is not loaded a
        second time.
        """
        p, run = self._p, self._run
        resumed = run.resume_once()
        if resumed is not None:
            run.check_steps_left(resumed)
        self._reporter.open_progress(initial=run.step)
        first = True
        try:
            while run.step < p.plan.total_steps:
                self._watchdog.arm(run.step, p.plan.first_step_seconds if first else p.plan.step_seconds)
                report = self._guarded_step()
                self._watchdog.disarm()
                first = False
                if report.rollback_due:
                    run.rollback()  # before anything of the non-finite state is saved
                    continue
                self._reporter.show(report)
                run.maybe_checkpoint(final=run.step == p.plan.total_steps or report.evaluation_improved)
            run.finalize()
            p.events.publish(TrainingFinished(steps=run.step))
        finally:
            self._watchdog.disarm()
            self._reporter.close()
            p.tracker.close()
            p.instruments.close()

    def _guarded_step(self) -> StepReport:
        """Runs one step; an error names the step and rank after the step in flight is reported."""
        try:
            return self._train_step()
        except NonFiniteError as e:
            hint = self._run.older_checkpoint_hint()
            if not hint:
                raise  # names the step already
            raise NonFiniteError(f"{e}; {hint}") from e
        except DataError:
            self._reporter.report_before_failing(self._run.step)
            raise  # names the file and line: the data's fault, not the step's
        except Exception as e:
            self._reporter.report_before_failing(self._run.step)
            # e.g. a collective that timed out: say where, then let the job end
            raise StepFailedError(
                f"step {self._run.step} failed on rank {self._p.dist_context.rank}: {type(e).__name__}: {e}"
            ) from e

    def _train_step(self) -> StepReport:
        """Runs one step; the report covers the steps whose figures it read (0, 1 or 2)."""
        computed = self._executor.forward_backward(self._run.step)
        # The previous step's figures, read now that this step's work keeps the device busy.
        previous = self._reporter.report_previous()
        if previous.rollback_due:
            # The previous step was not finite: this one is dropped; the rollback restores the
            # data position, the metrics and the state from before the bad step.
            self._executor.drop()
            return previous
        in_flight = self._executor.apply(computed)
        self._run.advance()
        return previous.then(self._reporter.finish(in_flight))

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
