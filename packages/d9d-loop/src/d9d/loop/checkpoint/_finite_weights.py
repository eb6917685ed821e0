"""Which parameters hold a NaN or an infinity: checked before a save and after a checkpoint loads.

A checkpoint of non-finite weights traps a run: every resume loads it and fails again. So the
trainer does not save such weights, and resume treats a checkpoint that holds them as unusable
and falls back to an older one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

_LISTED = 4


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nonfinite_parameters(stages: Sequence[nn.Module], group: ProcessGroup) -> list[str]:
    """Each parameter with a NaN or infinite element on any rank, with the count (collective).

    One reduction per parameter on the device and a single read back to the host; every rank
    of ``group`` returns the same sorted list (``"fc2.weight: 3 non-finite"``), empty when all
    are finite.
    """
    named = [(name, _local(p.detach())) for stage in stages for name, p in stage.named_parameters()]
    mine: list[str] = []
    if named:
        counts = [int(n) for n in torch.stack([(~torch.isfinite(t)).sum() for _, t in named]).cpu().unbind()]
        mine = [f"{name}: {n} non-finite" for (name, _), n in zip(named, counts, strict=True) if n]
    everyone: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return sorted({item for items in everyone if items for item in items})


def describe_nonfinite(found: Sequence[str]) -> str:
    """A short listing of ``nonfinite_parameters``'s result for a message."""
    listed = ", ".join(found[:_LISTED])
    return listed + (f" and {len(found) - _LISTED} more" if len(found) > _LISTED else "")
