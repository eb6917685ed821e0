"""Piecewise learning-rate schedules: warm-up, then constant / linear / cosine / exponential phases."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from d9d.loop._providers import LRSchedulerProviderContext
from d9d.loop.config._lr import (
    ConstantLRSchedulerConfig,
    ConstantPhase,
    CosinePhase,
    ExponentialPhase,
    LinearPhase,
    LRPhaseConfig,
    LRSchedulerConfig,
    PiecewiseLRSchedulerConfig,
)


@dataclass(kw_only=True, frozen=True)
class _Segment:
    start: int
    length: int
    start_factor: float
    phase: LRPhaseConfig | None  # None: the linear warm-up

    def factor_at(self, step: int) -> float:
        t = min(max((step - self.start) / self.length, 0.0), 1.0) if self.length else 1.0
        s = self.start_factor
        match self.phase:
            case None:
                return s + (1.0 - s) * t
            case ConstantPhase():
                return self.phase.factor
            case LinearPhase():
                return s + (self.phase.end_factor - s) * t
            case CosinePhase():
                e = self.phase.end_factor
                return e + (s - e) * 0.5 * (1.0 + math.cos(math.pi * t))
            case ExponentialPhase():
                return s * (self.phase.end_factor / s) ** t if s > 0 else 0.0

    @property
    def end_factor(self) -> float:
        return self.factor_at(self.start + self.length)


class PiecewiseSchedule:
    """The learning-rate multiplier at each optimizer step (a picklable callable for ``LambdaLR``)."""

    def __init__(self, config: PiecewiseLRSchedulerConfig, total_steps: int) -> None:
        segments: list[_Segment] = []
        warmup = config.warmup.length(total_steps)
        position = 0
        factor = 1.0
        if warmup > 0:
            segments.append(
                _Segment(start=0, length=warmup, start_factor=config.warmup.start_factor, phase=None)
            )
            position = warmup
        for phase in config.phases:
            segment = _Segment(
                start=position, length=phase.length(total_steps), start_factor=factor, phase=phase
            )
            segments.append(segment)
            position += segment.length
            factor = segment.end_factor
        self._segments = segments

    def __call__(self, step: int) -> float:
        for segment in self._segments:
            if step < segment.start + segment.length:
                return segment.factor_at(step)
        return self._segments[-1].end_factor if self._segments else 1.0


class AutoLRSchedulerProvider:
    """Builds the scheduler named by an ``LRSchedulerConfig``; fractions refer to the run's length."""

    def __init__(self, config: LRSchedulerConfig) -> None:
        self._config = config

    def build(self, context: LRSchedulerProviderContext) -> LRScheduler:
        config = self._config
        match config:
            case PiecewiseLRSchedulerConfig():
                config.check_run_length(context.total_steps)
                return LambdaLR(context.optimizer, PiecewiseSchedule(config, context.total_steps))
            case ConstantLRSchedulerConfig():
                return LambdaLR(context.optimizer, _constant_one)


def _constant_one(step: int) -> float:
    del step
    return 1.0
