"""Tensor shapes of a checkpoint against the state a run restores into, checked before DCP loads.

DCP reports a model whose width changed since the checkpoint as a long traceback per rank; this
finds the same before DCP runs and names each tensor with both shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful


def _tensors(prefix: str, value: object, out: dict[str, tuple[int, ...]]) -> None:
    if isinstance(value, Stateful):
        value = value.state_dict()
    if isinstance(value, torch.Tensor):
        out[prefix] = tuple(value.shape)  # a DTensor's global shape, as DCP records it
    elif isinstance(value, Mapping):
        for key, item in cast(Mapping[object, object], value).items():
            _tensors(f"{prefix}.{key}", item, out)


def tensor_shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``state`` by its DCP key (``model.fc1.weight``) with its global shape."""
    out: dict[str, tuple[int, ...]] = {}
    for key, value in state.items():
        _tensors(key, value, out)
    return out


def shape_mismatches(saved: Mapping[str, object], wanted: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Each tensor this run restores whose checkpoint shape differs or which the checkpoint lacks.

    Args:
        saved: The checkpoint's ``state_dict_metadata`` (DCP key to storage metadata).
        wanted: This run's tensors (``tensor_shapes``).
    """
    problems: list[str] = []
    for key, shape in sorted(wanted.items()):
        metadata = saved.get(key)
        if metadata is None:
            problems.append(f"{key} {list(shape)} is not in the checkpoint")
        elif isinstance(metadata, TensorStorageMetadata) and tuple(metadata.size) != shape:
            problems.append(f"{key} is {list(metadata.size)} in the checkpoint, {list(shape)} in this run")
    return problems
