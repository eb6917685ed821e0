"""The fields every provider hook over all of this rank's stages receives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from torch import nn

from d9d.mesh import DistributedContext
from d9d.pipeline import PipelineStageInfo

ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass(kw_only=True, frozen=True)
class RankStagesContext(Generic[ModelT]):
    """This rank's stages, as the hooks that see all of them at once receive them.

    Attributes:
        dist_context: The job's distributed context.
        stages: This rank's stages and their models, in increasing stage order.
    """

    dist_context: DistributedContext
    stages: Sequence[tuple[PipelineStageInfo, ModelT]]
