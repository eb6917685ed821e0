"""Where a step's wall time goes: data wait, forward-backward, optimizer, checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

StepPhase = Literal["data", "forward_backward", "optimizer"]


@dataclass(kw_only=True, frozen=True)
class StepTimes:
    """Seconds of one step by phase, read from host clocks.

    The loop waits for the device once per step anyway, to read the step's figures (at the step's
    end, or during the next step, see ``trainer.logging.read_figures``); no phase adds a wait of
    its own. ``checkpoint`` is the time between the previous step's end and this step's start:
    saving or finalizing a checkpoint, and the (small) progress-bar update.

    Attributes:
        data: Waiting for the batch and building the task's inputs.
        forward_backward: Forward and backward over the microbatches, and the loss reduction.
        optimizer: Gradient sync completion, clipping, the optimizer and LR scheduler steps.
        checkpoint: Between the previous step and this one (0 for the first step).
        wall: From the previous step's end to this step's end (from this step's start for the
            first one): what throughput divides by.
    """

    data: float
    forward_backward: float
    optimizer: float
    checkpoint: float
    wall: float


class StepTimer:
    """Splits each step into phases by host timestamps (``start``, ``lap`` per phase, ``finish``)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._previous_end: float | None = None
        self._started = 0.0
        self._mark = 0.0
        self._laps: dict[StepPhase, float] = {}

    def start(self) -> None:
        """Marks the start of a step."""
        self._started = self._mark = self._clock()
        self._laps = {}

    def lap(self, phase: StepPhase) -> None:
        """Marks the end of ``phase`` (the time since the previous mark)."""
        now = self._clock()
        self._laps[phase] = self._laps.get(phase, 0.0) + now - self._mark
        self._mark = now

    def finish(self) -> StepTimes:
        """Marks the end of the step and returns its split."""
        now = self._clock()
        begin = self._previous_end if self._previous_end is not None else self._started
        self._previous_end = now
        return StepTimes(
            data=self._laps.get("data", 0.0),
            forward_backward=self._laps.get("forward_backward", 0.0),
            optimizer=self._laps.get("optimizer", 0.0),
            checkpoint=self._started - begin,
            wall=now - begin,
        )

    def forget_previous(self) -> None:
        """Starts the next step afresh (after a resume or rollback, the gap is not a checkpoint)."""
        self._previous_end = None
