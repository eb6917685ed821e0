"""The plain values a run goes by, read once from the configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from d9d.loop._batch_layout import BatchLayout
from d9d.loop.config._trainer import ResumeConfig


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

    def logs_metrics(self, step: int) -> bool:
        """Whether ``step``'s metrics go to the tracker (every ``log_every_steps`` and the last)."""
        return step % self.log_every_steps == 0 or step + 1 == self.total_steps
