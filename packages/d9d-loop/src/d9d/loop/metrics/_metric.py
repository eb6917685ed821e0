"""The metric contract and a base for metrics whose state is a few summed tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from d9d.loop.step._device_scalars import device_scalar

MetricValue = torch.Tensor | Mapping[str, torch.Tensor]
"""What ``Metric.compute`` returns: a tensor (a scalar, or one value per class) or named tensors."""


class MetricInputError(ValueError):
    """A metric was fed values it cannot count (a label out of range, a shape mismatch)."""


@runtime_checkable
class Metric(Protocol):
    """Accumulates on the device, synchronizes over ranks, computes, resets, checkpoints.

    ``update`` adds a batch without host synchronization (its arguments are the metric's own);
    ``sync`` combines every rank's state over ``group`` (a collective: every rank calls it, in
    the same order); ``compute`` reads the synchronized state when ``sync`` ran since the last
    ``update``, else the local one; ``reset`` empties it. ``state_dict`` is this rank's local
    (unsynchronized) state, so a resumed run continues each rank's counts.
    """

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Adds one batch."""
        ...

    def sync(self, group: ProcessGroup | None) -> None:
        """Combines the state of every rank of ``group`` (all ranks of it must call this)."""
        ...

    def compute(self) -> MetricValue:
        """The metric's value over everything added (and synchronized) since the last reset."""
        ...

    def reset(self) -> None:
        """Forgets everything added."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's local state."""
        ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restores what ``state_dict`` returned."""
        ...


def distributed(group: ProcessGroup | None) -> bool:
    """Whether a collective over ``group`` means anything (a process group exists, more than one rank)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class SummedStateMetric:
    """A metric whose state is named tensors that add up over batches and over ranks.

    ``sync`` all-reduces every state in one collective (float64, so counts stay exact up to
    2**53). Subclasses declare states with ``_add_state`` and read them with ``_value``.
    """

    def __init__(self) -> None:
        self._defaults: dict[str, torch.Tensor] = {}
        self._states: dict[str, torch.Tensor] = {}
        self._synced: dict[str, torch.Tensor] | None = None

    def _add_state(self, name: str, default: torch.Tensor) -> None:
        self._defaults[name] = default
        self._states[name] = default.clone()

    def _accumulate(self, name: str, value: torch.Tensor) -> None:
        """Adds ``value`` to state ``name`` on ``value``'s device (the state follows it there)."""
        state = self._states[name]
        if state.device != value.device:
            if state.device.type == "cpu" and state.numel() == 1:
                state = device_scalar(state, device=value.device, dtype=state.dtype).reshape(state.shape)
            else:
                state = state.to(value.device)
        self._states[name] = state + value.to(state.dtype)
        self._synced = None

    def _value(self, name: str) -> torch.Tensor:
        return (self._synced if self._synced is not None else self._states)[name]

    def sync(self, group: ProcessGroup | None) -> None:
        """All-reduces the states (a sum) over ``group``; the local states stay as they were."""
        names = list(self._states)
        if not distributed(group):
            self._synced = dict(self._states)
            return
        flat = torch.cat([self._states[n].reshape(-1).to(torch.float64) for n in names])
        dist.all_reduce(flat, group=group)
        synced: dict[str, torch.Tensor] = {}
        offset = 0
        for name in names:
            local = self._states[name]
            synced[name] = flat[offset : offset + local.numel()].reshape(local.shape).to(local.dtype)
            offset += local.numel()
        self._synced = synced

    def reset(self) -> None:
        """Sets every state back to its default (on the device it lives on)."""
        for name, default in self._defaults.items():
            self._states[name] = default.to(self._states[name].device).clone()
        self._synced = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's local sums."""
        return {name: value.detach().clone() for name, value in self._states.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restores the local sums (on the device each state lives on now)."""
        for name in self._states:
            self._states[name] = state[name].to(self._states[name].device).clone()
        self._synced = None


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` with 0 where the denominator is 0 (scikit-learn's zero_division=0)."""
    denominator = denominator.to(torch.float64)
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1e-300), 0.0)


def check_labels(metric: str, labels: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Checks that integer ``labels`` lie in ``[low, high)``.

    On the CPU (no device synchronization to fear) raises at once; on an accelerator returns the
    number of bad labels as a device tensor, to be counted and reported by ``compute``.

    Raises:
        MetricInputError: On the CPU, naming the metric, the range and the bad values.
    """
    bad = (labels < low) | (labels >= high)
    if labels.device.type == "cpu" and bool(bad.any()):
        bad_values = cast(list[int], labels[bad].tolist())
        values = sorted(set(bad_values))[:5]
        raise MetricInputError(f"{metric} got labels {values} outside [{low}, {high})")
    return bad.sum()


def raise_if_bad(metric: str, bad_labels: torch.Tensor, low: int, high: int) -> None:
    """Raises when labels out of range were counted on an accelerator (read once, at compute)."""
    count = int(bad_labels.item())
    if count:
        raise MetricInputError(f"{metric} got {count} labels outside [{low}, {high})")
