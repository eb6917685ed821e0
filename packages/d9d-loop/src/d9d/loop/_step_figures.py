"""A step's figures read back to the host in one copy: loss, token and metric sums, gradient norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch


@dataclass(kw_only=True, frozen=True)
class StepFigures:
    """The host values of one step, from the reduced sums and the gradient norm.

    Attributes:
        loss: ``sum(weight * loss) / sum(weight)`` over every microbatch of every rank.
        weight: The summed loss weights.
        microbatches: Microbatches summed over the ranks that report them.
        tokens: Target tokens of the step.
        metric_sums: The task's per-step metric sums, in the order they were reduced.
        grad_norm: The gradient norm before clipping.
    """

    loss: float
    weight: float
    microbatches: float
    tokens: float
    metric_sums: tuple[float, ...]
    grad_norm: float

    @classmethod
    def read(cls, sums: torch.Tensor, grad_norm: torch.Tensor, step: int) -> StepFigures:
        """Copies ``sums`` (weighted loss, weight, microbatches, tokens, metric sums...) and the
        norm to the host at once: the step's only wait for the device.

        Raises:
            ValueError: If the loss weights sum to zero or less (nothing to learn from).
        """
        norm = grad_norm.detach().to(device=sums.device, dtype=sums.dtype).reshape(1)
        values = cast(list[float], torch.cat([sums, norm]).cpu().tolist())
        weighted_loss, weight, microbatches, tokens = values[:4]
        if weight <= 0:
            raise ValueError(
                f"step {step}: the loss weights of all microbatches sum to {weight}; nothing to learn from"
            )
        return cls(
            loss=weighted_loss / weight,
            weight=weight,
            microbatches=microbatches,
            tokens=tokens,
            metric_sums=tuple(values[4:-1]),
            grad_norm=values[-1],
        )
