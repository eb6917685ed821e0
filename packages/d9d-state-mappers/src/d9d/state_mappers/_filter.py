"""Filtering a mapper's outputs, for example to the parameters of one pipeline stage."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from d9d.state_mappers._group import GroupPlan, MapperGroup, StateMapper
from d9d.state_mappers._spec import Box, TensorSpec


class _RestrictedGroup(MapperGroup):
    def __init__(self, inner: MapperGroup, outputs: frozenset[str]) -> None:
        self._inner = inner
        self._outputs = outputs

    @property
    def inputs(self) -> frozenset[str]:
        return self._inner.inputs

    @property
    def outputs(self) -> frozenset[str]:
        return self._outputs

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return {n: s for n, s in self._inner.infer(input_specs).items() if n in self._outputs}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        if not self._outputs:
            return GroupPlan()
        return self._inner.plan(input_specs, {n: b for n, b in output_boxes.items() if n in self._outputs})

    def __repr__(self) -> str:
        return f"Restricted({sorted(self._outputs)}, {self._inner!r})"


class FilterMapper:
    """Keeps only the outputs of ``mapper`` for which ``keep(name)`` is true.

    A group whose outputs are all dropped still declares its inputs as consumed but reads
    nothing, so a full checkpoint passes strict validation when loading one pipeline stage.
    """

    def __init__(self, mapper: StateMapper, keep: Callable[[str], bool]) -> None:
        self._mapper = mapper
        self._keep = keep

    def groups(self) -> Sequence[MapperGroup]:
        out: list[MapperGroup] = []
        for group in self._mapper.groups():
            kept = frozenset(n for n in group.outputs if self._keep(n))
            out.append(group if kept == group.outputs else _RestrictedGroup(group, kept))
        return out
