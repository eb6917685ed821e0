"""Tensor metadata and boxes: the shapes, dtypes and slices a mapper plans with before any I/O.

A *box* is a rectangular slice of a tensor: one ``(start, stop)`` pair per tensor dim, in the
coordinates of the full (global) tensor. Mappers plan in boxes so that a rank holding one shard of
a parameter reads only the part of the checkpoint that the shard comes from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """The shape and dtype of a tensor, known without reading its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        """The spec of a tensor (the global shape for a DTensor)."""
        return cls(shape=tuple(tensor.shape), dtype=tensor.dtype)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}{list(self.shape)}"


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, int(size)) for size in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the slice a box selects."""
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    """Number of elements a box selects."""
    return math.prod(stop - start for start, stop in box)


def box_union(a: Box, b: Box) -> Box:
    """The smallest box holding both boxes (of the same tensor)."""
    return tuple((min(sa, sb), max(ea, eb)) for (sa, ea), (sb, eb) in zip(a, b, strict=True))


def box_union_all(boxes: Sequence[Box]) -> Box:
    """The smallest box holding every box of a non-empty sequence."""
    if not boxes:
        raise ValueError("the union of no boxes is undefined")
    out = boxes[0]
    for box in boxes[1:]:
        out = box_union(out, box)
    return out


def box_is_within(inner: Box, outer: Box) -> bool:
    """Whether ``inner`` lies inside ``outer``."""
    return len(inner) == len(outer) and all(
        so <= si and ei <= eo for (si, ei), (so, eo) in zip(inner, outer, strict=True)
    )


def box_with_dim(box: Box, dim: int, span: tuple[int, int]) -> Box:
    """``box`` with tensor dim ``dim`` replaced by ``span``."""
    return (*box[:dim], span, *box[dim + 1 :])


def box_insert_dim(box: Box, dim: int, span: tuple[int, int]) -> Box:
    """``box`` with a new tensor dim ``span`` inserted at position ``dim``."""
    return (*box[:dim], span, *box[dim:])


def box_remove_dim(box: Box, dim: int) -> Box:
    """``box`` without tensor dim ``dim``."""
    return (*box[:dim], *box[dim + 1 :])


@dataclass(frozen=True, kw_only=True)
class TensorPiece:
    """A slice of a tensor: ``data`` holds the elements of ``box`` of the full tensor."""

    data: torch.Tensor
    box: Box

    def narrow(self, box: Box) -> torch.Tensor:
        """The elements of ``box`` (which must lie inside this piece's box), as a view."""
        if box == self.box:
            return self.data
        if not box_is_within(box, self.box):
            raise ValueError(f"box {box} is not inside the piece's box {self.box}")
        out = self.data
        for dim, ((start, stop), (base, _)) in enumerate(zip(box, self.box, strict=True)):
            out = out.narrow(dim, start - base, stop - start)
        return out
