"""Helpers shared by the mappers that join or split tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from d9d.state_mappers._spec import TensorSpec


def check_same_spec(what: str, names: Sequence[str], specs: Mapping[str, TensorSpec]) -> TensorSpec:
    """The common spec of ``names``; raises naming the first tensor that differs."""
    first = specs[names[0]]
    for name in names[1:]:
        if specs[name] != first:
            raise ValueError(f"{what}: {name!r} is {specs[name]} but {names[0]!r} is {first}")
    return first


def check_dim(what: str, dim: int, ndim: int) -> None:
    """Raises unless ``dim`` indexes a tensor with ``ndim`` tensor dims."""
    if not 0 <= dim < ndim:
        raise ValueError(f"{what}: dim={dim} out of range for {ndim} tensor dims")


def check_unique(what: str, names: Sequence[str]) -> None:
    """Raises if a name repeats."""
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{what}: names repeat: {repeated}")
