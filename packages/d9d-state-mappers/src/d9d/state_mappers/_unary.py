"""Base of the leaf mappers that turn one tensor into one tensor."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping

import torch

from d9d.state_mappers._group import GroupPlan, MapperGroup
from d9d.state_mappers._spec import Box, TensorPiece, TensorSpec


class UnaryMapper(MapperGroup):
    """One input tensor to one output tensor; subclasses say how specs, boxes and data transform."""

    def __init__(self, source: str, target: str | None = None) -> None:
        self._source = source
        self._target = source if target is None else target

    @property
    def source(self) -> str:
        """The input name."""
        return self._source

    @property
    def target(self) -> str:
        """The output name."""
        return self._target

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset((self._source,))

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset((self._target,))

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return {self._target: self.infer_one(input_specs[self._source])}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        if self._target not in output_boxes:
            return GroupPlan()
        in_spec = input_specs[self._source]
        out_box = output_boxes[self._target]
        in_box = self.input_box(out_box, in_spec)
        source, target = self._source, self._target

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            return {target: self.compute(pieces[source].narrow(in_box), in_spec, in_box, out_box)}

        return GroupPlan(input_boxes={source: in_box}, run=run)

    @abstractmethod
    def infer_one(self, spec: TensorSpec) -> TensorSpec:
        """The output spec for an input spec."""

    @abstractmethod
    def input_box(self, out_box: Box, in_spec: TensorSpec) -> Box:
        """The input slice needed for the output slice ``out_box``."""

    @abstractmethod
    def compute(self, data: torch.Tensor, in_spec: TensorSpec, in_box: Box, out_box: Box) -> torch.Tensor:
        """Turns the input slice ``in_box`` (``data``) into the output slice ``out_box``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._source!r} -> {self._target!r})"
