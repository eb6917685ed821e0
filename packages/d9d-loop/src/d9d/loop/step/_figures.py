"""A step's figures read back to the host in one copy: loss, token and metric sums, gradient norm."""

from __future__ import annotations

import time
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
    def from_values(cls, values: list[float], step: int) -> StepFigures:
        """The figures from the host copy of ``[sums..., grad_norm]``.

        Raises:
            ValueError: If the loss weights sum to zero or less (nothing to learn from).
        """
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


@dataclass(kw_only=True, frozen=True)
class QueuedFigures:
    """A step's sums and gradient norm on their way to the host; ``read()`` waits for them.

    On CUDA the copy goes to pinned host memory behind the step's kernels and an event marks its
    end, so the host can queue the next step's work before it waits: the wait then ends when this
    step's kernels are done, while the device already runs the next step's.

    Attributes:
        step: The step whose figures these are.
    """

    step: int
    _host: torch.Tensor
    _copied: torch.cuda.Event | None

    @classmethod
    def queue(cls, sums: torch.Tensor, grad_norm: torch.Tensor, step: int) -> QueuedFigures:
        """Starts the copy of ``sums`` and the norm to the host, without waiting for it."""
        norm = grad_norm.detach().to(device=sums.device, dtype=sums.dtype).reshape(1)
        values = torch.cat([sums, norm])
        if values.device.type != "cuda":
            return cls(step=step, _host=values.cpu(), _copied=None)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(step=step, _host=host, _copied=copied)

    def wait(self, timeout_s: float) -> bool:
        """Waits at most ``timeout_s`` for the copy; whether it is there (for a failing run, where
        the device may never finish)."""
        if self._copied is None:
            return True
        deadline = time.monotonic() + timeout_s
        while not self._copied.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def read(self) -> StepFigures:
        """Waits for the copy and returns the figures.

        Raises:
            ValueError: If the loss weights sum to zero or less (nothing to learn from).
        """
        if self._copied is not None:
            self._copied.synchronize()
        return StepFigures.from_values(cast(list[float], self._host.tolist()), self.step)
