"""Tensor shapes of a checkpoint against the state a run restores into, checked before DCP loads.

DCP reports a model whose width changed since the checkpoint as a long traceback per rank; this
finds the same before DCP runs and names each tensor with both shapes. A changed dtype is no
error (DCP casts as it loads), but it is said: the config wins.
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


def _dtypes(prefix: str, value: object, out: dict[str, torch.dtype]) -> None:
    if isinstance(value, Stateful):
        value = value.state_dict()
    if isinstance(value, torch.Tensor):
        out[prefix] = value.dtype
    elif isinstance(value, Mapping):
        for key, item in cast(Mapping[object, object], value).items():
            _dtypes(f"{prefix}.{key}", item, out)


def model_dtypes(state: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """Every tensor of ``state["model"]`` by its DCP key with the dtype this run stores it in."""
    out: dict[str, torch.dtype] = {}
    if "model" in state:
        _dtypes("model", state["model"], out)
    return out


def dtype_changes(
    saved: Mapping[str, object], wanted: Mapping[str, torch.dtype]
) -> dict[str, tuple[str, str]]:
    """The model tensors whose dtype differs: DCP key to (checkpoint dtype, run dtype).

    Args:
        saved: The checkpoint's ``state_dict_metadata``.
        wanted: This run's model tensors (``model_dtypes``).
    """
    changed: dict[str, tuple[str, str]] = {}
    for key, dtype in wanted.items():
        metadata = saved.get(key)
        if isinstance(metadata, TensorStorageMetadata) and metadata.properties.dtype != dtype:
            changed[key] = (_dtype_name(metadata.properties.dtype), _dtype_name(dtype))
    return changed


def describe_dtype_changes(changed: Mapping[str, tuple[str, str]]) -> list[str]:
    """One line per (checkpoint dtype, run dtype) pair, with the number of tensors cast so."""
    counts: dict[tuple[str, str], int] = {}
    for pair in changed.values():
        counts[pair] = counts.get(pair, 0) + 1
    return [
        f"model parameter dtype: {old} in the checkpoint, {new} in the config ({count} tensors cast as "
        "they load; e.g. model.master_dtype / model.param_dtype)"
        for (old, new), count in sorted(counts.items())
    ]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
