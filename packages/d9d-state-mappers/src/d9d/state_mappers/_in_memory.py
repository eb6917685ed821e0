"""Applying a mapper to tensors already in memory."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from d9d.state_mappers._group import StateMapper
from d9d.state_mappers._spec import TensorPiece, TensorSpec, full_box
from d9d.state_mappers._validation import validate_mapping


def map_state_dict(
    mapper: StateMapper, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> dict[str, torch.Tensor]:
    """Applies ``mapper`` to an in-memory state dict, group by group.

    Args:
        mapper: Maps the names of ``state_dict`` to new names.
        state_dict: Input tensors (plain tensors or DTensors, for the DTensor mappers).
        strict: Whether entries that no group consumes are an error.

    Returns:
        The mapped tensors.

    Raises:
        StateMappingError: If the mapper does not fit ``state_dict``.
    """
    mapping = validate_mapping(mapper, {n: TensorSpec.of(t) for n, t in state_dict.items()}, strict=strict)
    out: dict[str, torch.Tensor] = {}
    for group, specs in zip(mapping.groups, mapping.input_specs, strict=True):
        plan = group.plan(specs, {o: full_box(mapping.output_specs[o].shape) for o in group.outputs})
        pieces = {
            n: TensorPiece(data=state_dict[n], box=full_box(state_dict[n].shape)) for n in plan.input_boxes
        }
        out.update(plan.run(pieces))
    return out
