"""Parallel composition: independent mappers side by side."""

from __future__ import annotations

from collections.abc import Sequence

from d9d.state_mappers._group import MapperGroup, StateMapper


class ParallelMapper:
    """The groups of every mapper, side by side.

    Outputs must not overlap (validation reports duplicates); inputs may be shared, for example
    one embedding read into both a tied input and output layer.
    """

    def __init__(self, mappers: Sequence[StateMapper]) -> None:
        self._mappers = tuple(mappers)

    def groups(self) -> Sequence[MapperGroup]:
        return tuple(group for mapper in self._mappers for group in mapper.groups())
