"""Consuming tensors without producing anything."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from d9d.state_mappers._group import GroupPlan, MapperGroup
from d9d.state_mappers._spec import Box, TensorSpec


class _DropGroup(MapperGroup):
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset((self._name,))

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset()

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return {}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        return GroupPlan()


class DropMapper:
    """Declares the named tensors as consumed and produces nothing; their data is never read.

    Use it for source entries the target does not want (for example a precomputed rotary table),
    so that strict validation still accounts for every source name.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._groups = tuple(_DropGroup(name) for name in names)

    def groups(self) -> Sequence[MapperGroup]:
        return self._groups
