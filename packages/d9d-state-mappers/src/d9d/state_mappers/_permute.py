"""Reordering tensor dims: permute and transpose."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d9d.state_mappers._spec import Box, TensorSpec
from d9d.state_mappers._unary import UnaryMapper


class PermuteMapper(UnaryMapper):
    """Permutes the tensor dims of ``source``: output dim ``i`` is input dim ``dims[i]``.

    The result is made contiguous, so what is stored has the new layout.
    """

    def __init__(self, source: str, dims: Sequence[int], *, target: str | None = None) -> None:
        super().__init__(source, target)
        if sorted(dims) != list(range(len(dims))):
            raise ValueError(f"dims={list(dims)} for {source!r} is not a permutation of 0..{len(dims) - 1}")
        self._dims = tuple(dims)

    def _check_ndim(self, spec: TensorSpec) -> None:
        if len(spec.shape) != len(self._dims):
            raise ValueError(
                f"permute of {self.source!r} with dims={list(self._dims)} needs {len(self._dims)} "
                f"tensor dims, got shape {list(spec.shape)}"
            )

    def infer_one(self, spec: TensorSpec) -> TensorSpec:
        self._check_ndim(spec)
        return TensorSpec(shape=tuple(spec.shape[d] for d in self._dims), dtype=spec.dtype)

    def input_box(self, out_box: Box, in_spec: TensorSpec) -> Box:
        in_box = [(0, 0)] * len(out_box)
        for out_dim, in_dim in enumerate(self._dims):
            in_box[in_dim] = out_box[out_dim]
        return tuple(in_box)

    def compute(self, data: torch.Tensor, in_spec: TensorSpec, in_box: Box, out_box: Box) -> torch.Tensor:
        return data.permute(self._dims).contiguous()


class TransposeMapper(PermuteMapper):
    """Swaps tensor dims ``dim0`` and ``dim1`` of ``source`` (a 2-D matrix transpose by default)."""

    def __init__(
        self, source: str, *, dim0: int = 0, dim1: int = 1, ndim: int = 2, target: str | None = None
    ) -> None:
        dims = list(range(ndim))
        if not (0 <= dim0 < ndim and 0 <= dim1 < ndim):
            raise ValueError(f"transpose of {source!r}: dims {dim0}, {dim1} out of range for ndim={ndim}")
        dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
        super().__init__(source, dims, target=target)
