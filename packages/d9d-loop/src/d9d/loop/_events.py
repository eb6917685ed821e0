"""Typed events fired at fixed points of a run, and the bus user code subscribes on."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from d9d.mesh import DistributedContext


@dataclass(kw_only=True, frozen=True)
class ConfigReady:
    """The distributed context exists and the configuration is resolved."""

    dist_context: DistributedContext


@dataclass(kw_only=True, frozen=True)
class ModelReady:
    """Every local model stage is parallelized, materialized and initialized (or loaded)."""

    model_stages: tuple[nn.Module, ...]


@dataclass(kw_only=True, frozen=True)
class StepStarted:
    """An optimizer step (0-based) is about to run."""

    step: int


@dataclass(kw_only=True, frozen=True)
class ForwardBackwardStarted:
    """Forward and backward over the step's microbatches begin."""

    step: int


@dataclass(kw_only=True, frozen=True)
class ForwardBackwardFinished:
    """Forward and backward are done; ``loss`` is the step's weighted mean loss over all ranks."""

    step: int
    loss: float


@dataclass(kw_only=True, frozen=True)
class OptimizerStepStarted:
    """Gradients are synchronized and clipped; the optimizer is about to step.

    With a ``GradientScalingOptimizer`` the clipping factor is applied by the step itself, so the
    stored gradients are not yet scaled here.
    """

    step: int


@dataclass(kw_only=True, frozen=True)
class OptimizerStepFinished:
    """The optimizer and LR scheduler stepped; ``grad_norm`` is the norm before clipping."""

    step: int
    learning_rate: float
    grad_norm: float


@dataclass(kw_only=True, frozen=True)
class StepFinished:
    """A step is complete; ``metrics`` are what was reported for it."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict[str, float])


@dataclass(kw_only=True, frozen=True)
class CheckpointSaved:
    """A checkpoint of the state after ``step`` steps became visible at ``path``."""

    step: int
    path: Path


@dataclass(kw_only=True, frozen=True)
class TrainingFinished:
    """The run reached its last step."""

    steps: int


EventT = TypeVar("EventT")


class EventBus:
    """Delivers events to the handlers subscribed to their exact type, in subscription order."""

    def __init__(self) -> None:
        self._handlers: defaultdict[type[Any], list[Callable[[Any], None]]] = defaultdict(list)

    def subscribe(self, event_type: type[EventT], handler: Callable[[EventT], None]) -> None:
        """Calls ``handler(event)`` for every published event of ``event_type``."""
        self._handlers[event_type].append(handler)

    def publish(self, event: object) -> None:
        """Delivers ``event`` to its subscribers."""
        for handler in self._handlers.get(type(event), ()):
            handler(event)
