"""The non-finite guard: what a NaN or infinite loss or gradient norm does to the run."""

from __future__ import annotations

import logging
import math
from enum import Enum

from d9d.loop.config._trainer import NonFiniteConfig, RollbackOnNonFinite, SkipNonFinite, StopOnNonFinite


class NonFiniteError(RuntimeError):
    """The loss or gradient norm was NaN or infinite; names the step and the values."""


class StepVerdict(Enum):
    """What the trainer does with a step after the guard looked at it."""

    APPLY = "apply"  # finite: the optimizer steps
    SKIP = "skip"  # the optimizer step is left out; parameters stay as they were
    ROLLBACK = "rollback"  # a checkpoint is reloaded before anything is saved (older if it fails again)


class NonFiniteGuard:
    """Checks each step's loss and gradient norm, which the trainer reads back anyway.

    Both are read with the step's other figures after the optimizer's kernels are queued (at the
    step's end or during the next step), so the host does not wait before them; under ``skip`` they
    must be known before the step: then they are read before it, still once.
    """

    def __init__(self, config: NonFiniteConfig, logger: logging.LoggerAdapter[logging.Logger]) -> None:
        self._config = config
        self._logger = logger
        self._consecutive_skips = 0
        self._rollbacks = 0

    @property
    def reads_norm_before_step(self) -> bool:
        """Whether the gradient norm must be read before the optimizer step."""
        return isinstance(self._config, SkipNonFinite)

    @property
    def in_streak(self) -> bool:
        """Whether the last step was skipped as not finite (``skip``); nothing is saved then."""
        return self._consecutive_skips > 0

    def check(self, *, step: int, loss: float, grad_norm: float | None) -> StepVerdict:
        """Decides about a step from its loss and (when read already) its gradient norm.

        Raises:
            NonFiniteError: Under ``stop``, or when ``skip`` / ``rollback`` reached their limit.
        """
        finite_norm = grad_norm is None or math.isfinite(grad_norm)
        if math.isfinite(loss) and finite_norm:
            self._consecutive_skips = 0
            return StepVerdict.APPLY
        what = f"step {step}: loss {loss}" + ("" if grad_norm is None else f", gradient norm {grad_norm}")
        config = self._config
        match config:
            case StopOnNonFinite():
                raise NonFiniteError(
                    f"{what} is not finite; stopping (trainer.nonfinite.policy=stop); the checkpoints "
                    f"on disk predate this step"
                )
            case SkipNonFinite():
                self._consecutive_skips += 1
                if self._consecutive_skips > config.max_consecutive:
                    raise NonFiniteError(
                        f"{what} is not finite for {self._consecutive_skips} steps in a row "
                        f"(trainer.nonfinite.max_consecutive={config.max_consecutive}); stopping"
                    )
                self._logger.warning("%s is not finite; skipping the optimizer step", what)
                return StepVerdict.SKIP
            case RollbackOnNonFinite():
                self._rollbacks += 1
                if self._rollbacks > config.max_rollbacks:
                    raise NonFiniteError(
                        f"{what} is not finite after {config.max_rollbacks} rollbacks "
                        f"(trainer.nonfinite.max_rollbacks); stopping"
                    )
                self._logger.warning("%s is not finite; rolling back to a checkpoint", what)
                return StepVerdict.ROLLBACK
