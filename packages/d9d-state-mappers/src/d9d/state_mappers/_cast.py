"""Changing a tensor's dtype."""

from __future__ import annotations

import torch

from d9d.state_mappers._spec import Box, TensorSpec
from d9d.state_mappers._unary import UnaryMapper


class CastMapper(UnaryMapper):
    """Casts tensor ``source`` to ``dtype``, named ``target`` (``source`` when None)."""

    def __init__(self, source: str, dtype: torch.dtype, *, target: str | None = None) -> None:
        super().__init__(source, target)
        self._dtype = dtype

    def infer_one(self, spec: TensorSpec) -> TensorSpec:
        return TensorSpec(shape=spec.shape, dtype=self._dtype)

    def input_box(self, out_box: Box, in_spec: TensorSpec) -> Box:
        return out_box

    def compute(self, data: torch.Tensor, in_spec: TensorSpec, in_box: Box, out_box: Box) -> torch.Tensor:
        return data.to(self._dtype)
