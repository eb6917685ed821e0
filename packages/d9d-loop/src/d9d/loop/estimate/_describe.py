"""The model provider's hook for the memory estimate: its input and its result."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.loop.estimate._shape import ModelMemoryShape
from d9d.mesh import MeshParameters


@dataclass(kw_only=True, frozen=True)
class DescribeMemoryContext:
    """Input of ``ModelProvider.describe_memory``: called before any process group or weight.

    Attributes:
        mesh: The job's parallelism degrees.
    """

    mesh: MeshParameters


@dataclass(kw_only=True, frozen=True)
class DescribeMemoryResult:
    """The model's shape for the memory estimate.

    Attributes:
        shape: The model's numbers and compute settings; None: unknown (no estimate is made).
    """

    shape: ModelMemoryShape | None = None
