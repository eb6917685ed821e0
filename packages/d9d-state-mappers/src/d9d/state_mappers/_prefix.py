"""Prefix scope: a mapper written for one submodule, placed at a path of the whole model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.state_mappers._group import GroupPlan, MapperGroup, StateMapper
from d9d.state_mappers._spec import Box, TensorPiece, TensorSpec


class _PrefixedGroup(MapperGroup):
    def __init__(self, inner: MapperGroup, input_prefix: str, output_prefix: str) -> None:
        self._inner = inner
        self._in = input_prefix
        self._out = output_prefix

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset(self._in + n for n in self._inner.inputs)

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset(self._out + n for n in self._inner.outputs)

    def _inner_specs(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return {n: input_specs[self._in + n] for n in self._inner.inputs}

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return {self._out + n: s for n, s in self._inner.infer(self._inner_specs(input_specs)).items()}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        inner_boxes = {
            n: output_boxes[self._out + n] for n in self._inner.outputs if self._out + n in output_boxes
        }
        plan = self._inner.plan(self._inner_specs(input_specs), inner_boxes)
        in_prefix, out_prefix = self._in, self._out

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            out = plan.run({n: pieces[in_prefix + n] for n in plan.input_boxes})
            return {out_prefix + n: t for n, t in out.items()}

        return GroupPlan(input_boxes={in_prefix + n: b for n, b in plan.input_boxes.items()}, run=run)

    def __repr__(self) -> str:
        return f"Prefixed({self._in!r} -> {self._out!r}, {self._inner!r})"


class PrefixMapper:
    """Scopes ``mapper`` under name prefixes: its input names get ``input_prefix``, outputs ``output_prefix``.

    Example: a mapper for one decoder layer's local names, placed at
    ``input_prefix="model.layers.3."``, ``output_prefix="layers.3."``.
    """

    def __init__(self, mapper: StateMapper, *, input_prefix: str = "", output_prefix: str = "") -> None:
        self._mapper = mapper
        self._input_prefix = input_prefix
        self._output_prefix = output_prefix

    def groups(self) -> Sequence[MapperGroup]:
        return tuple(
            _PrefixedGroup(g, self._input_prefix, self._output_prefix) for g in self._mapper.groups()
        )
