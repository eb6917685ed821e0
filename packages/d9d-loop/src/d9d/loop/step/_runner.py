"""Forward and backward over one step's microbatches (without pipeline parallelism)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from d9d.loop._task import ComputeLossContext, TrainTask
from d9d.loop.step._device_scalars import device_scalar
from d9d.loop.step._gradient_manager import GradientManager
from d9d.mesh import shard_tree


@dataclass(kw_only=True)
class MicrobatchTotals:
    """Sums over this rank's microbatches of a step."""

    losses: list[torch.Tensor] = field(default_factory=list[torch.Tensor])  # detached, on the device
    # Weights stay device tensors when the task gives tensors (token counts): no host sync per
    # microbatch; the trainer reads their sum back once, with the loss.
    loss_weights: list[torch.Tensor | float] = field(default_factory=list[torch.Tensor | float])
    weight: torch.Tensor | float = 0.0
    # Device tensors stay unread (summed on the device) until the trainer reads the step once.
    metric_sums: dict[str, torch.Tensor | float] = field(
        default_factory=lambda: defaultdict[str, torch.Tensor | float](float)
    )
    microbatches: int = 0

    def add(self, loss: torch.Tensor, weight: torch.Tensor | float) -> None:
        """Records one microbatch's loss without waiting for it (no host sync)."""
        self.losses.append(loss.detach())
        self.loss_weights.append(weight)
        self.weight = self.weight + weight
        self.microbatches += 1

    def add_metric(self, name: str, value: torch.Tensor | float) -> None:
        """Adds one microbatch's value of a metric without waiting for it (no host sync)."""
        if isinstance(value, torch.Tensor):
            value = value.detach().float().reshape(())
        self.metric_sums[name] = self.metric_sums[name] + value

    def weighted_loss(self, device: torch.device) -> torch.Tensor | float:
        """``sum(weight * loss)``: a float on the CPU, a device scalar elsewhere (read once later)."""
        if not self.losses:
            return 0.0
        if device.type == "cpu":
            return sum(float(loss) * float(w) for loss, w in zip(self.losses, self.loss_weights, strict=True))
        weights = torch.stack(
            [device_scalar(w, device=device, dtype=torch.float32) for w in self.loss_weights]
        )
        return (torch.stack(self.losses).float().reshape(-1) * weights).sum()


class StepRunner(Protocol):
    """Runs forward and backward for every microbatch of a step on this rank."""

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes losses (holds the last pipeline stage)."""
        ...

    def run(
        self, *, inputs: Any, states: Any, shared: Any, num_microbatches: int, step: int
    ) -> MicrobatchTotals:
        """Accumulates gradients of ``sum(weight * loss)`` and returns the local totals.

        ``inputs`` and ``states`` are the rank's whole step; they are split into
        ``num_microbatches`` along tensor dim 0.
        """
        ...


def loss_weight_of(value: torch.Tensor | float | None) -> torch.Tensor | float:
    """A microbatch's loss weight (1 when the task gives none); a tensor stays on its device."""
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        return value.detach().float().reshape(())
    return float(value)


class SequentialStepRunner:
    """Microbatch after microbatch on one model stage: forward, loss, backward."""

    def __init__(
        self, *, model: nn.Module, task: TrainTask[Any, Any, Any, Any, Any], gradients: GradientManager
    ) -> None:
        self._model = model
        self._task = task
        self._gradients = gradients

    @property
    def has_last_stage(self) -> bool:
        return True

    def run(
        self, *, inputs: Any, states: Any, shared: Any, num_microbatches: int, step: int
    ) -> MicrobatchTotals:
        totals = MicrobatchTotals()
        input_chunks = shard_tree(inputs, num_shards=num_microbatches)
        state_chunks = shard_tree(states, num_shards=num_microbatches)
        for index, (microbatch_input, state) in enumerate(zip(input_chunks, state_chunks, strict=True)):
            output = self._model(microbatch_input, shared)
            result = self._task.compute_loss(
                ComputeLossContext(pipeline_results=output, state=state, microbatch_index=index, step=step)
            )
            weight = loss_weight_of(result.loss_weight)
            self._gradients.begin_microbatch(is_last=index == num_microbatches - 1)
            (result.loss * (weight / num_microbatches)).backward()
            totals.add(result.loss, weight)
            for name, value in result.metrics.items():
                totals.add_metric(name, value)
        return totals
