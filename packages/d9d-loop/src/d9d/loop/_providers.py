"""Contracts of the data, optimizer and LR-scheduler providers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from d9d.mesh import DistributedContext

BatchT_co = TypeVar("BatchT_co", covariant=True)


class DataError(ValueError):
    """A batch source met input it cannot use (a malformed line, a sample without a field).

    The message names the file and line. The trainer lets it through as it is, not as a failed
    step, so bad data met mid-run (streaming) reads like bad data met while loading.
    """


@dataclass(kw_only=True, frozen=True)
class DataProviderContext:
    """What a data provider needs to shard data for this rank.

    Attributes:
        dist_context: The job's distributed context.
        global_batch_size: Samples per optimizer step over all data-parallel ranks.
        local_batch_size: Samples this rank reads per step (``global_batch_size / dp_size``).
        dp_rank: This rank's data shard (its ``dp`` coordinate in the batch domain).
        dp_size: Number of data shards.
    """

    dist_context: DistributedContext
    global_batch_size: int
    local_batch_size: int
    dp_rank: int
    dp_size: int


class BatchSource(Protocol[BatchT_co]):
    """A stateful stream of per-step batches for one rank.

    ``state_dict`` captures the position after the batches already returned, so a resumed run
    gets exactly the next batch.
    """

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one pass over the data."""
        ...

    def next_batch(self) -> BatchT_co:
        """This rank's batch for the next step.

        Raises:
            DataError: On input it cannot use (read as the batches are taken: streaming).
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position in the data."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from a position saved by ``state_dict``."""
        ...


class DataProvider(Protocol[BatchT_co]):
    """Builds this rank's batch source."""

    def build(self, context: DataProviderContext) -> BatchSource[BatchT_co]:
        """Returns the batch source for this rank."""
        ...


@dataclass(kw_only=True, frozen=True)
class OptimizerProviderContext:
    """What an optimizer provider gets: every model stage held by this rank."""

    dist_context: DistributedContext
    model_stages: Sequence[nn.Module]


class OptimizerProvider(Protocol):
    """Builds one optimizer over the parameters of all local model stages."""

    def build(self, context: OptimizerProviderContext) -> torch.optim.Optimizer:
        """Returns the optimizer."""
        ...


@runtime_checkable
class GradientScalingOptimizer(Protocol):
    """An optimizer that can multiply the gradients by a factor itself, as it reads them.

    When the built optimizer has this method (d9d-kernels' ``StochasticAdamW`` does), the trainer
    leaves the gradients unscaled and unclipped after the backward and passes the factor
    (loss-weight correction times clipping coefficient) to the step instead: one pass over the
    gradients less per step.
    """

    def step_with_gradient_scale(self, scale: torch.Tensor) -> None:
        """Steps as if every gradient were first multiplied by ``scale`` (a device scalar)."""
        ...


@dataclass(kw_only=True, frozen=True)
class LRSchedulerProviderContext:
    """What an LR-scheduler provider gets."""

    dist_context: DistributedContext
    optimizer: torch.optim.Optimizer
    total_steps: int


class LRSchedulerProvider(Protocol):
    """Builds the learning-rate scheduler, stepped once per optimizer step."""

    def build(self, context: LRSchedulerProviderContext) -> LRScheduler:
        """Returns the scheduler."""
        ...
