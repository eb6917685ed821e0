"""How data-parallel gradients are combined across ranks."""

from __future__ import annotations

from typing import Literal

from torch.distributed.tensor import Partial

GradientReduction = Literal["mean", "sum"]
"""``"mean"`` averages gradients over data-parallel ranks (what DDP and FSDP do); ``"sum"`` adds
them, for a loop that scales the loss by its own global weight."""


def partial_for(reduction: GradientReduction) -> Partial:
    """The ``Partial`` placement that marks a pending data-parallel reduction of this kind."""
    match reduction:
        case "mean":
            return Partial("avg")
        case "sum":
            return Partial("sum")
