"""On resume the config wins: settings a checkpoint restores are put back to the configured values.

A checkpoint restores the optimizer's hyperparameters (in its param groups) and the LR
scheduler's base learning rates; left alone they would silently override a changed config, and
a changed run length would make the learning rate jump one step after resuming. After loading,
``reapply`` restores every configured value, recomputes the learning rate of the resumed step
from the configured schedule, and returns one line per setting that differs from the
checkpoint's, for the trainer to print.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

# Param-group keys that are not hyperparameters to report: the parameters, the scheduled lr
# (reported through the base lr and the schedule), and implementation choices (foreach, fused:
# they follow the device; still restored to the configured value, without a line).
_NOT_REPORTED = frozenset({"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"})


@dataclass(kw_only=True, frozen=True)
class ConfiguredSettings:
    """What the config set, read from the optimizer and scheduler before any checkpoint loads.

    Attributes:
        groups: Each param group's hyperparameters (everything but ``params`` and ``lr``).
        base_lrs: The scheduler's base learning rate per group (``optimizer.lr``).
        total_steps: Optimizer steps of the run (the schedule's horizon).
        global_batch_size: Samples per optimizer step.
        data_source: What the batch source names its data (the ``source`` of its state; None:
            it names none).
    """

    groups: tuple[Mapping[str, object], ...]
    base_lrs: tuple[float, ...]
    total_steps: int
    global_batch_size: int
    data_source: str | None = None


def capture_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    *,
    total_steps: int,
    global_batch_size: int,
    data_source: str | None = None,
) -> ConfiguredSettings:
    """Reads the configured settings; call before a checkpoint is loaded."""
    groups = tuple(
        {k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
        for group in optimizer.param_groups
    )
    return ConfiguredSettings(
        groups=groups,
        base_lrs=tuple(float(b) for b in scheduler.base_lrs),
        total_steps=total_steps,
        global_batch_size=global_batch_size,
        data_source=data_source,
    )


def _normal(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return cast(object, value.detach().cpu().tolist())
    if isinstance(value, list | tuple):
        return tuple(_normal(v) for v in cast(Sequence[object], value))
    return value


def _name(key: str, index: int, groups: int) -> str:
    return f"optimizer.{key}" if groups == 1 else f"optimizer.{key} (param group {index})"


def _configured_lrs(
    scheduler: LRScheduler, configured: ConfiguredSettings, saved_base: Sequence[float]
) -> list[float]:
    """The learning rate of the resumed step under the configured schedule and base lr."""
    current = [float(lr) for lr in scheduler.get_last_lr()]
    if isinstance(scheduler, LambdaLR):
        # rebuilt from the config: the multiplier of the restored step, times the configured lr
        return [
            base * float(fn(scheduler.last_epoch))
            for base, fn in zip(configured.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
    # another scheduler: its schedule scales with the base lr
    return [
        lr * base / old if old else base
        for lr, base, old in zip(current, configured.base_lrs, saved_base, strict=True)
    ]


def reapply(
    configured: ConfiguredSettings,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    saved_total_steps: int | None,
    saved_global_batch_size: int | None,
    saved_data_source: str | None = None,
) -> list[str]:
    """Puts the configured settings back after a checkpoint loaded its own (the config wins).

    Args:
        configured: The settings read before loading.
        optimizer: The optimizer, its param groups as the checkpoint left them.
        scheduler: The scheduler, its state as the checkpoint left it.
        saved_total_steps: The run length the checkpoint was written with (None: not recorded).
        saved_global_batch_size: Its samples per step (None: not recorded); the data source
            converted its position already, this only names the change: the step counter is
            kept (``max_steps`` and the LR schedule count optimizer steps), the data position is
            kept in samples.
        saved_data_source: What the checkpoint's batch source named its data (None: nothing
            recorded); a change is named, the saved position applies to the new data.

    Returns:
        One line per setting whose checkpoint value differs from the config's, then the learning
        rate of the resumed step when it changed; empty when the config matches the checkpoint.
    """
    saved_base = [float(b) for b in scheduler.base_lrs]
    return [
        *_restore_groups(optimizer, configured),
        *_base_lr_changes(saved_base, configured.base_lrs),
        *_run_changes(
            configured,
            saved_total_steps=saved_total_steps,
            saved_global_batch_size=saved_global_batch_size,
            saved_data_source=saved_data_source,
            step=scheduler.last_epoch,
        ),
        *_restore_schedule(optimizer, scheduler, configured, saved_base),
    ]


def _restore_groups(optimizer: torch.optim.Optimizer, configured: ConfiguredSettings) -> list[str]:
    """Puts each param group's configured hyperparameters back; one line per reported change."""
    changes: list[str] = []
    count = len(optimizer.param_groups)
    for index, (group, wanted) in enumerate(zip(optimizer.param_groups, configured.groups, strict=True)):
        for key, value in wanted.items():
            if key not in _NOT_REPORTED and _normal(group.get(key)) != _normal(value):
                changes.append(
                    f"{_name(key, index, count)}: {group.get(key)} in the checkpoint, {value} in the config"
                )
            group[key] = value
    return changes


def _base_lr_changes(saved_base: Sequence[float], configured_base: Sequence[float]) -> list[str]:
    """One line per param group whose base learning rate the checkpoint had otherwise."""
    count = len(saved_base)
    return [
        f"{_name('lr', index, count)}: {old:.6g} in the checkpoint, {new:.6g} in the config"
        for index, (old, new) in enumerate(zip(saved_base, configured_base, strict=True))
        if old != new
    ]


def _run_changes(
    configured: ConfiguredSettings,
    *,
    saved_total_steps: int | None,
    saved_global_batch_size: int | None,
    saved_data_source: str | None,
    step: int,
) -> list[str]:
    """Lines naming a changed run length, global batch or data (the checkpoint recorded them)."""
    changes: list[str] = []
    if saved_total_steps is not None and saved_total_steps != configured.total_steps:
        changes.append(
            f"the run's length (trainer.max_steps / epochs, the LR schedule's horizon): "
            f"{saved_total_steps} steps in the checkpoint, {configured.total_steps} in the config"
        )
    if saved_global_batch_size is not None and saved_global_batch_size != configured.global_batch_size:
        changes.append(
            f"trainer.global_batch_size: {saved_global_batch_size} in the checkpoint, "
            f"{configured.global_batch_size} in the config: the step stays {step} "
            "(trainer.max_steps and the LR schedule count optimizer steps), the data continues at the "
            "next unread sample (its position is kept in samples)"
        )
    if (
        saved_data_source is not None
        and configured.data_source is not None
        and saved_data_source != configured.data_source
    ):
        changes.append(
            f"the data: {saved_data_source} in the checkpoint, {configured.data_source} in the config "
            "(read from the saved position: epoch and sample)"
        )
    return changes


def _restore_schedule(
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    configured: ConfiguredSettings,
    saved_base: Sequence[float],
) -> list[str]:
    """Sets the configured base lrs and the resumed step's lr from the configured schedule.

    Returns:
        The line naming the resumed step's learning rate when the config's schedule changes it.
    """
    saved_lrs = [float(lr) for lr in scheduler.get_last_lr()]
    new_lrs = _configured_lrs(scheduler, configured, saved_base)
    changes: list[str] = []
    if new_lrs != saved_lrs:
        changes.append(
            f"learning rate at step {scheduler.last_epoch}: {_listed(saved_lrs)} in the checkpoint, "
            f"{_listed(new_lrs)} from the config's schedule"
        )
    for group, base, lr in zip(optimizer.param_groups, configured.base_lrs, new_lrs, strict=True):
        group["initial_lr"] = base
        group["lr"] = lr
    state: dict[str, Any] = scheduler.state_dict()
    scheduler.load_state_dict({**state, "base_lrs": list(configured.base_lrs), "_last_lr": new_lrs})
    return changes


def _listed(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.6g}" for v in values)
