"""What a checkpoint holds of a run: its stateful objects by key, and the step count it restores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from d9d.loop._providers import BatchSource
from d9d.loop._task import TrainTask
from d9d.loop.checkpoint._manifest import RunLayout
from d9d.loop.checkpoint._train_state import (
    ModelState,
    ObjectState,
    OptimizerState,
    RandomState,
    scheduler_state,
)
from d9d.loop.config._run_plan import RunPlan
from d9d.loop.evaluation._evaluation import Evaluator
from d9d.loop.metrics import MetricSet
from d9d.loop.observability._trackers import Tracker


def data_source(state: object) -> str | None:
    """What a batch source's state names its data (its ``source``), None where it names none."""
    source = cast(dict[str, object], state).get("source") if isinstance(state, dict) else None
    return source if isinstance(source, str) else None


@dataclass(kw_only=True, frozen=True)
class SavedSettings:
    """What the last loaded checkpoint says its run was set to (None: it does not say).

    Attributes:
        total_steps: The saved run's optimizer steps (absent in checkpoints of older d9d).
        global_batch_size: The saved data position's global batch size.
        data_source: The saved data position's source.
    """

    total_steps: int | None = None
    global_batch_size: int | None = None
    data_source: str | None = None


class RunContents:
    """The keys of a run's checkpoint and the objects behind them, on this rank.

    ``model``, ``optimizer``, ``trainer`` (the step, data position, LR schedule, task, tracker,
    evaluation), this rank's random state and, where the task has training metrics, this rank's
    partial metrics window. Loading restores ``step`` and records the ``saved`` settings.
    """

    def __init__(
        self,
        *,
        rank: int,
        plan: RunPlan,
        models: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LRScheduler,
        batches: BatchSource[Any],
        task: TrainTask[Any, Any, Any, Any, Any],
        tracker: Tracker,
        evaluator: Evaluator | None,
        train_metrics: MetricSet | None,
    ) -> None:
        self._rank = rank
        self._plan = plan
        self._models = list(models)
        self._optimizer = optimizer
        self._scheduler = lr_scheduler
        self._batches = batches
        self._task = task
        self._tracker = tracker
        self._evaluator = evaluator
        self._metrics = train_metrics
        self.step = 0  # optimizer steps completed so far
        self.saved = SavedSettings()

    @property
    def random_key(self) -> str:
        """The key of this rank's random state."""
        return f"rng_rank{self._rank}"

    @property
    def metrics_key(self) -> str:
        """The key of this rank's training-metrics window."""
        return f"train_metrics_rank{self._rank}"

    def state(self, with_optimizer: bool = True) -> dict[str, Any]:
        """The stateful objects a checkpoint saves or loads, by key."""
        state: dict[str, Any] = {
            "model": ModelState(self._models, trainable_only=self._plan.checkpoint_trainable_only),
            "optimizer": OptimizerState(self._models, self._optimizer),
            "trainer": ObjectState(self._trainer_state, self._load_trainer_state),
            self.random_key: RandomState(),
        }
        if self._metrics:
            # Each rank's partial window (the updates since the last logged step) differs: one key per rank.
            state[self.metrics_key] = ObjectState(self._metrics_state, self._load_metrics_state)
        if not with_optimizer:
            del state["optimizer"]
        return state

    def layout(self) -> RunLayout:
        """What a checkpoint's manifest records of the run's layout."""
        return RunLayout(
            global_batch_size=self._plan.batch.global_batch_size, optimizer=type(self._optimizer).__name__
        )

    def _metrics_state(self) -> dict[str, Any]:
        assert self._metrics is not None
        state = self._metrics.state_dict()
        return {name: {k: v.detach().cpu() for k, v in sums.items()} for name, sums in state.items()}

    def _load_metrics_state(self, state: dict[str, Any]) -> None:
        assert self._metrics is not None
        self._metrics.load_state_dict(state)

    def _trainer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step,
            "total_steps": self._plan.total_steps,
            "data": self._batches.state_dict(),
            "lr_scheduler": scheduler_state(self._scheduler),
            "task": self._task.state_dict(),
            "tracker": self._tracker.state_dict(),
        }
        if self._evaluator is not None:
            state["evaluation"] = self._evaluator.state_dict()
        return state

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        saved_total: object = state.get("total_steps")  # absent in checkpoints of older d9d
        data: object = state["data"]
        saved_global = (
            cast(dict[str, object], data).get("global_batch_size") if isinstance(data, dict) else None
        )
        self.saved = SavedSettings(
            total_steps=saved_total if isinstance(saved_total, int) else None,
            global_batch_size=saved_global if isinstance(saved_global, int) else None,
            data_source=data_source(state["data"]),
        )
        self._batches.load_state_dict(state["data"])
        self._scheduler.load_state_dict({**self._scheduler.state_dict(), **state["lr_scheduler"]})
        self._task.load_state_dict(state["task"])
        self._tracker.load_state_dict(state["tracker"])
        if self._evaluator is not None:
            # A checkpoint from before evaluation was configured has no best yet: none so far.
            self._evaluator.load_state_dict(state.get("evaluation", {}))
