"""Explicit all-gather prefetch between FSDP units, for ranks whose host cannot run ahead."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule


def prefetch_fsdp_units(
    units: Sequence[nn.Module], *, forward: int = 1, backward: int = 1
) -> list[FSDPModule]:
    """Makes each FSDP unit start the all-gathers of its neighbours before it computes.

    FSDP2 gathers a unit's parameters when the host reaches that unit's forward (or backward);
    a host-bound rank then issues each gather only just before it is needed, and the GPU waits
    for it. With explicit prefetch a unit's pre-forward hook also issues the gathers of the next
    ``forward`` units, and its pre-backward hook those of the ``backward`` units before it (in
    forward order), so they run on the communication stream while this unit computes. Numerics
    are unchanged; more gathered parameters are held at a time (up to ``1 + max(forward,
    backward)`` units instead of about two).

    Args:
        units: The units in forward order (e.g. the decoder layers of a stage); modules that are
            not ``FSDPModule`` (a rank with nothing to shard) are skipped.
        forward: How many following units each unit prefetches in forward (0: FSDP's implicit
            one-unit-ahead behaviour only).
        backward: How many preceding units each unit prefetches in backward (0: implicit).

    Returns:
        The FSDP units that were given prefetch targets' lists (in forward order).

    Raises:
        ValueError: If ``forward`` or ``backward`` is negative.
    """
    if forward < 0 or backward < 0:
        raise ValueError(f"prefetch counts must be >= 0, got forward={forward}, backward={backward}")
    sharded: list[FSDPModule] = [unit for unit in units if isinstance(unit, FSDPModule)]
    for index, unit in enumerate(sharded):
        if forward > 0:
            ahead = sharded[index + 1 : index + 1 + forward]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
        if backward > 0:
            behind = sharded[max(0, index - backward) : index][::-1]
            if behind:
                unit.set_modules_to_backward_prefetch(behind)
    return sharded
