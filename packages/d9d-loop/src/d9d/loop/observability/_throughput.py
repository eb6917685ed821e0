"""Throughput smoothed over a window of steps, so the figure a user watches does not jump."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class _StepWork:
    seconds: float
    samples: float
    tokens: float


class SmoothedThroughput:
    """Samples and tokens per second over the last ``window`` steps (work over wall time).

    A ratio of sums, not a mean of per-step rates: a slow step (a checkpoint, the first step's
    warm-up) counts by its duration and leaves the window after ``window`` steps.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"the throughput window must hold at least one step, got {window}")
        self._steps: deque[_StepWork] = deque(maxlen=window)
        self._seconds = 0.0
        self._samples = 0.0
        self._tokens = 0.0

    def add(self, *, seconds: float, samples: float, tokens: float) -> None:
        """Records one step that did ``samples`` (and ``tokens``) of work in ``seconds`` of wall time."""
        if len(self._steps) == self._steps.maxlen:
            oldest = self._steps[0]
            self._seconds -= oldest.seconds
            self._samples -= oldest.samples
            self._tokens -= oldest.tokens
        self._steps.append(_StepWork(seconds=seconds, samples=samples, tokens=tokens))
        self._seconds += seconds
        self._samples += samples
        self._tokens += tokens

    @property
    def samples_per_second(self) -> float:
        """Samples per second over the window (0 before the first step)."""
        return self._samples / self._seconds if self._seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second over the window (0 when the task reports no token counts)."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0
