"""Whether the state after a step may be saved: never during a non-finite streak or with NaN weights.

A checkpoint saved in the middle of a streak of skipped non-finite steps (``skip``) can hold
weights that diverged already (finite, ~5e28, NaN on the next forward); one whose weights are
NaN traps every resume. A save that falls due then is deferred to the next finite step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from d9d.loop.checkpoint._finite_weights import describe_nonfinite
from d9d.loop.step._nonfinite_guard import NonFiniteGuard


class CheckpointGate:
    """Decides per due save whether to write it now or defer it to the next finite step.

    Holds whether a save is pending from an earlier deferral; every rank decides the same (the
    guard sees the reduced loss and norm, and the weight check is collective).
    """

    def __init__(
        self,
        *,
        guard: NonFiniteGuard,
        nonfinite_weights: Callable[[], list[str]],
        logger: logging.LoggerAdapter[logging.Logger],
        is_main_process: bool,
    ) -> None:
        self._guard = guard
        self._nonfinite_weights = nonfinite_weights
        self._logger = logger
        self._is_main = is_main_process
        self._deferred = False

    def should_save(self, *, step: int, due: bool) -> bool:
        """Whether to save the state after ``step`` steps, given the schedule says ``due``.

        Logs a warning (main rank) when a due save is deferred, naming why.
        """
        if not (due or self._deferred):
            return False
        reason = self._reason_not_to_save()
        if reason is None:
            self._deferred = False
            return True
        self._deferred = True
        if self._is_main:
            self._logger.warning(
                "not saving the checkpoint of step %d: %s; saving after the next finite step instead",
                step,
                reason,
            )
        return False

    def _reason_not_to_save(self) -> str | None:
        if self._guard.in_streak:
            return "the last step was not finite (trainer.nonfinite.policy=skip skipped it)"
        found = self._nonfinite_weights()
        if found:
            return f"the weights are not finite ({describe_nonfinite(found)})"
        return None
