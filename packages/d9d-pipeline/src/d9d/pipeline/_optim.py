"""Steps the optimizers and LR schedulers of all of a rank's stages as one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch.optim import Optimizer


class LRSchedulerLike(Protocol):
    """The part of ``torch.optim.lr_scheduler.LRScheduler`` the wrapper uses."""

    def step(self) -> None: ...

    def get_last_lr(self) -> list[float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class StagesOptimizer:
    """One optimizer per local stage, used as one: ``step``, ``zero_grad`` and state dicts.

    Args:
        optimizers: The optimizers, one per local stage in increasing stage order.

    Its state dict is ``{"stage_0": ..., "stage_1": ...}`` by position in ``optimizers``.
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        if not optimizers:
            raise ValueError("StagesOptimizer needs at least one optimizer")
        self.optimizers = list(optimizers)

    def step(self) -> None:
        """Steps every stage's optimizer."""
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradients of every stage."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """All param groups of all stages, in stage order."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Every stage's optimizer state, keyed ``stage_<position>``."""
        return {f"stage_{i}": opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved.

        Raises:
            KeyError: If a stage's entry is missing, naming it.
        """
        for i, opt in enumerate(self.optimizers):
            key = f"stage_{i}"
            if key not in state_dict:
                raise KeyError(f"optimizer state for '{key}' is missing; found {sorted(state_dict)}")
            opt.load_state_dict(state_dict[key])


class StagesLRScheduler:
    """One LR scheduler per local stage, stepped as one.

    Args:
        schedulers: The schedulers, one per local stage in increasing stage order.
    """

    def __init__(self, schedulers: Sequence[LRSchedulerLike]) -> None:
        if not schedulers:
            raise ValueError("StagesLRScheduler needs at least one scheduler")
        self.schedulers = list(schedulers)

    def step(self) -> None:
        """Steps every stage's scheduler."""
        for sched in self.schedulers:
            sched.step()

    def get_last_lr(self) -> list[float]:
        """The learning rates of the first stage's scheduler (all stages share a schedule)."""
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """Every stage's scheduler state, keyed ``stage_<position>``."""
        return {f"stage_{i}": s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved.

        Raises:
            KeyError: If a stage's entry is missing, naming it.
        """
        for i, sched in enumerate(self.schedulers):
            key = f"stage_{i}"
            if key not in state_dict:
                raise KeyError(f"LR scheduler state for '{key}' is missing; found {sorted(state_dict)}")
            sched.load_state_dict(state_dict[key])
