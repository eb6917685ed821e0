"""Scheduling and running groups over a checkpoint, file by file, in bounded memory.

The schedule is computed from metadata alone: tensors are read file by file (within a file, in
the order of the first group needing them), a group runs as soon as its last input is read, and
an input is freed as soon as the last group needing it has run. A group whose inputs span files
is held until its last input arrives. Peak memory is therefore what the pending groups hold, not
the size of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch
from tqdm import tqdm

from d9d.state_mappers._checkpoint_reader import SafetensorsCheckpoint
from d9d.state_mappers._group import GroupPlan
from d9d.state_mappers._prefetch import DEFAULT_READ_AHEAD_BYTES, Prefetcher
from d9d.state_mappers._spec import Box, TensorPiece, box_numel, box_union_all


@dataclass(frozen=True, kw_only=True)
class _Read:
    name: str
    box: Box


@dataclass(frozen=True, kw_only=True)
class _Run:
    group: int


@dataclass(frozen=True, kw_only=True)
class _Free:
    name: str


Action = _Read | _Run | _Free


@dataclass(frozen=True, kw_only=True)
class StreamSchedule:
    """The ordered reads, group runs and frees of one pass over a checkpoint."""

    actions: tuple[Action, ...]
    read_bytes: int

    @property
    def run_order(self) -> list[int]:
        """Group indices in the order they run."""
        return [a.group for a in self.actions if isinstance(a, _Run)]


def build_schedule(checkpoint: SafetensorsCheckpoint, plans: Sequence[GroupPlan]) -> StreamSchedule:
    """Orders reads and group runs so that each group runs as early as possible."""
    users: dict[str, list[int]] = {}
    wanted: dict[str, list[Box]] = {}
    for index, plan in enumerate(plans):
        for name, box in plan.input_boxes.items():
            users.setdefault(name, []).append(index)
            wanted.setdefault(name, []).append(box)
    boxes = {name: box_union_all(b) for name, b in wanted.items()}
    remaining = [len(plan.input_boxes) for plan in plans]
    references = {name: len(u) for name, u in users.items()}
    actions: list[Action] = [_Run(group=i) for i, count in enumerate(remaining) if count == 0]
    read_bytes = 0
    specs = checkpoint.specs
    for file in checkpoint.files:
        names = [n for n in checkpoint.names_in(file) if n in boxes]
        names.sort(key=lambda n: min(users[n]))
        for name in names:
            actions.append(_Read(name=name, box=boxes[name]))
            box = boxes[name]
            read_bytes += specs[name].dtype.itemsize * box_numel(box)
            for group in users[name]:
                remaining[group] -= 1
                if remaining[group] == 0:
                    actions.append(_Run(group=group))
                    for used in plans[group].input_boxes:
                        references[used] -= 1
                        if references[used] == 0:
                            actions.append(_Free(name=used))
    return StreamSchedule(actions=tuple(actions), read_bytes=read_bytes)


def run_schedule(
    checkpoint: SafetensorsCheckpoint,
    plans: Sequence[GroupPlan],
    schedule: StreamSchedule,
    emit: Callable[[str, torch.Tensor], None],
    *,
    progress: tqdm[NoReturn] | None = None,
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
) -> None:
    """Executes a schedule, handing every produced output to ``emit`` as soon as it exists.

    Reads run ahead on a background thread, at most ``read_ahead_bytes`` ahead of their use.
    """
    reads = [(a.name, a.box) for a in schedule.actions if isinstance(a, _Read)]
    prefetcher = Prefetcher(checkpoint, reads, max_bytes=read_ahead_bytes)
    pieces: dict[str, TensorPiece] = {}
    try:
        for action in schedule.actions:
            match action:
                case _Read(name=name, box=box):
                    data = prefetcher.next(name)
                    pieces[name] = TensorPiece(data=data, box=box)
                    if progress is not None:
                        progress.update(data.numel() * data.element_size())
                case _Run(group=group):
                    plan = plans[group]
                    for name, tensor in plan.run({n: pieces[n] for n in plan.input_boxes}).items():
                        emit(name, tensor)
                case _Free(name=name):
                    del pieces[name]
    finally:
        prefetcher.close()
