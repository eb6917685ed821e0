"""The mapper contract: a mapper declares groups up front, then is applied one group at a time."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from d9d.state_mappers._spec import Box, TensorPiece, TensorSpec

RunFn = Callable[[Mapping[str, TensorPiece]], dict[str, torch.Tensor]]


def _run_nothing(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
    del pieces
    return {}


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """How one group produces the requested slices of its outputs.

    Attributes:
        input_boxes: The slice of each input to read; inputs left out are not read at all.
        run: Given a piece holding (at least) each planned input box, returns each requested
            output, exactly the requested box of it.
    """

    input_boxes: dict[str, Box] = field(default_factory=dict[str, Box])
    run: RunFn = _run_nothing


class MapperGroup(ABC):
    """The unit of work of a mapper: a set of input names that together produce output names.

    A group is planned from metadata only (``infer`` and ``plan``), so that a whole graph is
    validated and scheduled before any tensor is read; ``plan`` returns the function that then
    runs on the data. A leaf mapper is a single group, so every group is also a mapper.
    """

    @property
    @abstractmethod
    def inputs(self) -> frozenset[str]:
        """Names the group consumes."""

    @property
    @abstractmethod
    def outputs(self) -> frozenset[str]:
        """Names the group produces (empty for a group that only consumes, such as a drop)."""

    @abstractmethod
    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """The spec of every output, given the spec of every input.

        Raises:
            ValueError: If the inputs do not fit the operation; the message names the tensors.
        """

    @abstractmethod
    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        """Plans producing ``output_boxes`` (a subset of the outputs, each a box of its full tensor)."""

    def groups(self) -> Sequence[MapperGroup]:
        """A leaf mapper is its own single group."""
        return (self,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({sorted(self.inputs)} -> {sorted(self.outputs)})"


@runtime_checkable
class StateMapper(Protocol):
    """Anything that declares its groups: a leaf mapper, a composition, or a user's own class."""

    def groups(self) -> Sequence[MapperGroup]:
        """The groups, in a stable order; their outputs must not overlap."""
        ...
