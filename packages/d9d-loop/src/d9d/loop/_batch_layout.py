"""Batch maths in one place: how a global batch splits over data-parallel ranks and microbatches."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.mesh import MeshParameters


@dataclass(kw_only=True, frozen=True)
class BatchLayout:
    """How one optimizer step's samples are spread.

    Attributes:
        global_batch_size: Samples per optimizer step over all data-parallel ranks.
        data_parallel_size: Number of data shards (ranks that read different samples).
        microbatch_size: Samples per forward/backward on one rank.
    """

    global_batch_size: int
    data_parallel_size: int
    microbatch_size: int

    def __post_init__(self) -> None:
        per_step = self.data_parallel_size * self.microbatch_size
        if self.global_batch_size % per_step != 0:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size} is not divisible by "
                f"data-parallel size ({self.data_parallel_size}) x trainer.microbatch_size "
                f"({self.microbatch_size}) = {per_step}"
            )

    @classmethod
    def of(cls, mesh: MeshParameters, *, global_batch_size: int, microbatch_size: int) -> BatchLayout:
        """The layout of a job on ``mesh``; raises ``ValueError`` naming the keys if it does not split."""
        return cls(
            global_batch_size=global_batch_size,
            data_parallel_size=mesh.data_parallel,
            microbatch_size=microbatch_size,
        )

    @property
    def local_batch_size(self) -> int:
        """Samples one data-parallel rank reads per step."""
        return self.global_batch_size // self.data_parallel_size

    @property
    def microbatches_per_step(self) -> int:
        """Forward/backward passes per step on one rank (gradient accumulation steps)."""
        return self.local_batch_size // self.microbatch_size
