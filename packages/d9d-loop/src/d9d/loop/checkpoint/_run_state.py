"""What is saved, resumed and rolled back of a run, behind one object the Trainer calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from d9d.loop._events import CheckpointSaved, EventBus
from d9d.loop.checkpoint._checkpointer import Checkpointer, CheckpointLocation
from d9d.loop.checkpoint._finite_weights import nonfinite_parameters
from d9d.loop.checkpoint._gate import CheckpointGate
from d9d.loop.checkpoint._resume import load_newest_usable, older_checkpoint_hint
from d9d.loop.checkpoint._resume_settings import ConfiguredSettings, reapply
from d9d.loop.checkpoint._rollback_walk import RollbackWalk
from d9d.loop.checkpoint._run_contents import RunContents
from d9d.loop.config._run_plan import RunPlan
from d9d.loop.metrics import MetricSet
from d9d.loop.observability._run_instruments import RunInstruments
from d9d.loop.observability._trackers import Tracker
from d9d.loop.step._nonfinite_guard import NonFiniteError, NonFiniteGuard
from d9d.mesh import DistributedContext


@dataclass(kw_only=True, frozen=True)
class _ResumeAttempt:
    """That ``resume()`` ran, and the checkpoint it loaded (None: none)."""

    location: CheckpointLocation | None


class RunState:
    """The run's step count and its checkpoints: save when due, resume, fall back, roll back.

    Saves go through the gate (never during a non-finite streak or with non-finite weights);
    resume loads the newest usable checkpoint and puts the configured settings back (the config
    wins); a rollback walks to older checkpoints while the run keeps failing at the same place.
    """

    def __init__(
        self,
        *,
        contents: RunContents,
        configured: ConfiguredSettings,
        dist_context: DistributedContext,
        plan: RunPlan,
        checkpointer: Checkpointer | None,
        models: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler,
        tracker: Tracker,
        train_metrics: MetricSet | None,
        instruments: RunInstruments,
        events: EventBus,
        guard: NonFiniteGuard,
    ) -> None:
        self._contents = contents
        self._configured = configured  # what the config set, before any checkpoint restores its own
        self._dist = dist_context
        self._plan = plan
        self._checkpointer = checkpointer
        self._models = list(models)
        self._optimizer = optimizer
        self._scheduler = lr_scheduler
        self._tracker = tracker
        self._metrics = train_metrics
        self._instruments = instruments
        self._events = events
        self._attempt: _ResumeAttempt | None = None
        self._rollback_walk = RollbackWalk()
        self._gate = CheckpointGate(
            guard=guard,
            nonfinite_weights=self._nonfinite_weights,
            logger=dist_context.logger,
            is_main_process=dist_context.is_main_process,
        )

    @property
    def step(self) -> int:
        """Optimizer steps completed so far."""
        return self._contents.step

    def advance(self) -> None:
        """Counts one more completed optimizer step."""
        self._contents.step += 1

    def resume(self) -> CheckpointLocation | None:
        """Loads the newest usable checkpoint if resume is on (``resume.from_step``: that one)."""
        options = self._plan.resume
        from_step = options.from_step if options is not None else None
        self._attempt = _ResumeAttempt(location=self._load(older_than=None, from_step=from_step))
        return self._attempt.location

    def resume_once(self) -> CheckpointLocation | None:
        """The checkpoint ``resume()`` loaded if it ran already, else what it loads now."""
        return self._attempt.location if self._attempt is not None else self.resume()

    def check_steps_left(self, resumed: CheckpointLocation) -> None:
        """Says that a resumed run has nothing to train, or refuses one resumed past its end."""
        step, total = self.step, self._plan.total_steps
        if step > total:
            raise ValueError(
                f"resumed from {resumed.path} at step {step}, past this run's {total} steps "
                "(trainer.max_steps / epochs): nothing would be trained. Raise max_steps, resume from "
                "an older checkpoint (trainer.checkpoint.resume: {from_step: N}) or use another "
                "trainer.checkpoint.directory"
            )
        if step == total and self._dist.is_main_process:
            self._dist.logger.warning(
                "already finished at step %d (resumed from %s): nothing to train", step, resumed.path
            )

    def checkpoint_due(self, done: int) -> bool:
        """Whether the checkpoint interval falls after ``done`` finished steps (with a checkpointer)."""
        return self._checkpointer is not None and done % self._plan.checkpoint_every_steps == 0

    def maybe_checkpoint(self, *, final: bool) -> None:
        """Saves the state after this step when due (or ``final``) and the gate allows it."""
        if self._checkpointer is None:
            return
        due = final or self.checkpoint_due(self.step)
        if self._gate.should_save(step=self.step, due=due):
            self._checkpointer.save(
                self.step, self._contents.state(), self._on_checkpoint_visible, layout=self._contents.layout()
            )
        else:
            self._checkpointer.finalize(self._on_checkpoint_visible)

    def finalize(self) -> None:
        """Waits for a save in progress to become visible."""
        if self._checkpointer is not None:
            self._checkpointer.finalize(self._on_checkpoint_visible)

    def rollback(self) -> None:
        """Goes back to the checkpoint before a non-finite step (older ones while it fails again).

        Raises:
            NonFiniteError: If there is no checkpoint (or no older one) to roll back to.
        """
        self.finalize()
        failed_step = self.step
        older_than = self._rollback_walk.older_than(failed_step)
        location = self._load(older_than=older_than)
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
        if self._dist.is_main_process:
            self._dist.logger.warning(
                "step %d was not finite: rolled back to %s", failed_step - 1, location.path
            )

    def older_checkpoint_hint(self) -> str:
        """Names the checkpoint the run resumed from and how to resume from an older one."""
        if self._checkpointer is None:
            return ""
        resumed = self._attempt.location if self._attempt is not None else None
        return older_checkpoint_hint(resumed, self._checkpointer.on_disk())

    def _nonfinite_weights(self) -> list[str]:
        return nonfinite_parameters(self._models, self._dist.world_group())

    def _on_checkpoint_visible(self, location: CheckpointLocation) -> None:
        self._events.publish(CheckpointSaved(step=location.step, path=location.path))

    def _load(self, *, older_than: int | None, from_step: int | None = None) -> CheckpointLocation | None:
        """Loads the newest usable checkpoint (of fewer steps than ``older_than``), then the config wins."""
        checkpointer, options, contents = self._checkpointer, self._plan.resume, self._contents
        if checkpointer is None or options is None:
            return None
        resumed = load_newest_usable(
            checkpointer,
            state=contents.state,
            optional=(contents.random_key, contents.metrics_key),
            layout=contents.layout(),
            options=options,
            logger=self._dist.logger,
            nonfinite_weights=self._nonfinite_weights,
            older_than=older_than,
            from_step=from_step,
        )
        if resumed is None:
            return None
        location = resumed.location
        if contents.random_key in resumed.absent:
            # The checkpoint was written by fewer ranks (resharded resume): this rank keeps its seed.
            self._dist.logger.warning(
                "%s has no random state for this rank; keeping the seeded one", location.path
            )
        if self._metrics and contents.metrics_key in resumed.absent:
            # Fewer ranks, or a checkpoint from before metrics were saved: this rank's window starts empty.
            self._metrics.reset()
        saved = contents.saved
        changed = resumed.cast + reapply(
            self._configured,
            optimizer=self._optimizer,
            scheduler=self._scheduler,
            saved_total_steps=saved.total_steps,
            saved_global_batch_size=saved.global_batch_size,
            saved_data_source=saved.data_source,
        )
        if self._dist.is_main_process:
            for line in changed:
                self._dist.logger.warning("resuming from %s, the config wins: %s", location.path, line)
            self._tracker.on_resume(self.step)
        self._instruments.resumed()
        self._dist.logger.info("resumed from %s at step %d", location.path, self.step)
        return location
