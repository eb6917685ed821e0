"""Reshaping a tensor."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from d9d.state_mappers._spec import Box, TensorPiece, TensorSpec, full_box
from d9d.state_mappers._unary import UnaryMapper


class ReshapeMapper(UnaryMapper):
    """Reshapes ``source`` to ``shape`` (one entry may be -1), keeping the row-major element order.

    A slice of a reshaped tensor is generally not a box of the original, so a sliced request
    reads the whole input and cuts the slice out afterwards.
    """

    def __init__(self, source: str, shape: Sequence[int], *, target: str | None = None) -> None:
        super().__init__(source, target)
        if sum(1 for s in shape if s == -1) > 1 or any(s < -1 for s in shape):
            raise ValueError(f"reshape of {source!r}: invalid shape {list(shape)}")
        self._shape = tuple(shape)

    def infer_one(self, spec: TensorSpec) -> TensorSpec:
        known = math.prod(s for s in self._shape if s != -1)
        if -1 in self._shape:
            if known == 0 or spec.numel % known != 0:
                raise ValueError(
                    f"cannot reshape {self.source!r} of shape {list(spec.shape)} to {list(self._shape)}"
                )
            shape = tuple(spec.numel // known if s == -1 else s for s in self._shape)
        else:
            shape = self._shape
        if math.prod(shape) != spec.numel:
            raise ValueError(
                f"cannot reshape {self.source!r} of shape {list(spec.shape)} to {list(self._shape)}"
            )
        return TensorSpec(shape=shape, dtype=spec.dtype)

    def input_box(self, out_box: Box, in_spec: TensorSpec) -> Box:
        return full_box(in_spec.shape)

    def compute(self, data: torch.Tensor, in_spec: TensorSpec, in_box: Box, out_box: Box) -> torch.Tensor:
        out_shape = self.infer_one(in_spec).shape
        return TensorPiece(data=data.reshape(out_shape), box=full_box(out_shape)).narrow(out_box)
