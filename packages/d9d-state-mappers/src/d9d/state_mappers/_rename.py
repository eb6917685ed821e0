"""Mappers that move tensors unchanged: identity, rename, select."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from d9d.state_mappers._group import MapperGroup
from d9d.state_mappers._spec import Box, TensorSpec
from d9d.state_mappers._unary import UnaryMapper


class RenameMapper(UnaryMapper):
    """Passes tensor ``source`` through unchanged under the name ``target``."""

    def __init__(self, source: str, target: str) -> None:
        super().__init__(source, target)

    def infer_one(self, spec: TensorSpec) -> TensorSpec:
        return spec

    def input_box(self, out_box: Box, in_spec: TensorSpec) -> Box:
        return out_box

    def compute(self, data: torch.Tensor, in_spec: TensorSpec, in_box: Box, out_box: Box) -> torch.Tensor:
        return data


class IdentityMapper(RenameMapper):
    """Passes tensor ``name`` through unchanged under the same name."""

    def __init__(self, name: str) -> None:
        super().__init__(name, name)


class SelectMapper:
    """Passes the named tensors through unchanged: one identity group per name."""

    def __init__(self, names: Iterable[str]) -> None:
        self._groups = tuple(IdentityMapper(name) for name in names)

    def groups(self) -> Sequence[MapperGroup]:
        return self._groups
