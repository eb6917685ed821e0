"""Parallelism degrees of a job and the checks that make a layout valid."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MeshParameters(BaseModel):
    """Degrees of every parallelism a job combines on one device mesh.

    The world size is ``pipeline_parallel * data_parallel_replicate * data_parallel_shard *
    context_parallel_shard * context_parallel_replicate * tensor_parallel``. Expert parallelism
    does not add ranks: experts are sharded over ``expert_parallel`` of the ranks inside one
    pipeline stage, so it must divide the number of ranks per stage.

    Attributes:
        pipeline_parallel: Number of pipeline stages groups (pp).
        data_parallel_replicate: Data-parallel replicas that hold full copies (DDP / HSDP outer dim).
        data_parallel_shard: Data-parallel ranks that shard parameters (FSDP).
        context_parallel_shard: Context-parallel ranks that also shard parameters with FSDP.
        context_parallel_replicate: Context-parallel ranks that replicate parameters.
        tensor_parallel: Tensor-parallel degree (tp).
        expert_parallel: Ranks that experts are sharded over (ep).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pipeline_parallel: int = Field(default=1, ge=1)
    data_parallel_replicate: int = Field(default=1, ge=1)
    data_parallel_shard: int = Field(default=1, ge=1)
    context_parallel_shard: int = Field(default=1, ge=1)
    context_parallel_replicate: int = Field(default=1, ge=1)
    tensor_parallel: int = Field(default=1, ge=1)
    expert_parallel: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check_expert_parallel_divides(self) -> MeshParameters:
        if self.ranks_per_stage % self.expert_parallel != 0:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} does not divide the ranks of one pipeline stage "
                f"(data_parallel_replicate * data_parallel_shard * context_parallel_shard * "
                f"context_parallel_replicate * tensor_parallel = {self.ranks_per_stage})"
            )
        return self

    @property
    def ranks_per_stage(self) -> int:
        """Number of ranks that hold one pipeline stage."""
        return math.prod(
            (
                self.data_parallel_replicate,
                self.data_parallel_shard,
                self.context_parallel_shard,
                self.context_parallel_replicate,
                self.tensor_parallel,
            )
        )

    @property
    def world_size(self) -> int:
        """Number of ranks this layout needs."""
        return self.pipeline_parallel * self.ranks_per_stage

    @property
    def data_parallel(self) -> int:
        """Total data-parallel degree (replicate times shard)."""
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def context_parallel(self) -> int:
        """Total context-parallel degree (shard times replicate)."""
        return self.context_parallel_shard * self.context_parallel_replicate

    @property
    def has_pipeline_parallel(self) -> bool:
        """Whether the model is split into pipeline stages."""
        return self.pipeline_parallel > 1

    def check_world_size(self, world_size: int) -> None:
        """Raises if this layout does not use exactly ``world_size`` ranks.

        Args:
            world_size: The number of processes the job was started with.

        Raises:
            ValueError: Naming both numbers and the degrees that make up the product.
        """
        if self.world_size != world_size:
            raise ValueError(
                f"mesh needs {self.world_size} ranks (pipeline_parallel={self.pipeline_parallel} x "
                f"data_parallel_replicate={self.data_parallel_replicate} x "
                f"data_parallel_shard={self.data_parallel_shard} x "
                f"context_parallel_shard={self.context_parallel_shard} x "
                f"context_parallel_replicate={self.context_parallel_replicate} x "
                f"tensor_parallel={self.tensor_parallel}) but the world size is {world_size}"
            )
