"""Schedule configuration: a pydantic union discriminated by ``name``, resolved into a program."""

from __future__ import annotations

from typing import Annotated, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._schedules._dualpipev import build_dualpipev_program
from d9d.pipeline._schedules._interleaved import build_interleaved_1f1b_program, build_looped_bfs_program
from d9d.pipeline._schedules._simple import (
    build_1f1b_program,
    build_forward_only_program,
    build_gpipe_program,
)
from d9d.pipeline._schedules._zero_bubble import build_interleaved_zero_bubble_program, build_zbv_program
from d9d.pipeline._stage_info import PipelineStageInfo


@runtime_checkable
class PipelineScheduleBuilder(Protocol):
    """Anything that builds a pipeline program: every built-in schedule config, or a user's own.

    A new schedule needs no change to d9d: write a function that returns a ``PipelineProgram``
    (``make_program`` inserts the communication) and an object with this method; pass it to the
    trainer, or call ``build_program`` on it.
    """

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """The program for ``num_ranks`` pipeline ranks and ``num_microbatches`` per step."""
        ...


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GPipeScheduleConfig(_Config):
    """All forwards, then all backwards; one stage per rank."""

    name: Literal["gpipe"] = "gpipe"

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_gpipe_program(num_ranks=num_ranks, num_microbatches=num_microbatches)


class OneFOneBScheduleConfig(_Config):
    """1F1B: one forward, one backward after a warm-up; one stage per rank."""

    name: Literal["1f1b"] = "1f1b"

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_1f1b_program(num_ranks=num_ranks, num_microbatches=num_microbatches)


class Interleaved1F1BScheduleConfig(_Config):
    """Interleaved 1F1B; ``stages_per_rank`` stages per rank on a loop placement."""

    name: Literal["interleaved_1f1b"] = "interleaved_1f1b"
    stages_per_rank: int = Field(default=2, ge=1)

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_interleaved_1f1b_program(
            num_ranks=num_ranks, num_microbatches=num_microbatches, stages_per_rank=self.stages_per_rank
        )


class LoopedBFSScheduleConfig(_Config):
    """Looped breadth-first; ``stages_per_rank`` stages per rank on a loop placement."""

    name: Literal["looped_bfs"] = "looped_bfs"
    stages_per_rank: int = Field(default=2, ge=1)

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_looped_bfs_program(
            num_ranks=num_ranks, num_microbatches=num_microbatches, stages_per_rank=self.stages_per_rank
        )


class InterleavedZeroBubbleScheduleConfig(_Config):
    """Interleaved zero-bubble (split backward); ``stages_per_rank`` stages per rank."""

    name: Literal["interleaved_zero_bubble"] = "interleaved_zero_bubble"
    stages_per_rank: int = Field(default=2, ge=1)

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_interleaved_zero_bubble_program(
            num_ranks=num_ranks, num_microbatches=num_microbatches, stages_per_rank=self.stages_per_rank
        )


class ZBVScheduleConfig(_Config):
    """ZBV: two stages per rank in a V, split backward."""

    name: Literal["zbv"] = "zbv"

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_zbv_program(num_ranks=num_ranks, num_microbatches=num_microbatches)


class DualPipeVScheduleConfig(_Config):
    """DualPipeV: two stages per rank in a V; needs at least ``2 * ranks`` microbatches.

    Attributes:
        overlap: Run each forward that DualPipeV pairs with a backward of the other stage
            interleaved with it (at the stages' overlap points, each stage on its own CUDA
            stream), so one's communication can hide behind the other's compute. Off by default:
            it costs host time per pair and per turn, which only hidden communication repays
            (measurements in docs/pipeline.md).
    """

    name: Literal["dualpipev"] = "dualpipev"
    overlap: bool = False

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_dualpipev_program(
            num_ranks=num_ranks, num_microbatches=num_microbatches, overlap=self.overlap
        )


class ForwardOnlyScheduleConfig(_Config):
    """Inference: forwards only, one stage per rank."""

    name: Literal["forward_only"] = "forward_only"

    def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
        """Builds this schedule's program."""
        return build_forward_only_program(num_ranks=num_ranks, num_microbatches=num_microbatches)


PipelineScheduleConfig = Annotated[
    GPipeScheduleConfig
    | OneFOneBScheduleConfig
    | Interleaved1F1BScheduleConfig
    | LoopedBFSScheduleConfig
    | InterleavedZeroBubbleScheduleConfig
    | ZBVScheduleConfig
    | DualPipeVScheduleConfig
    | ForwardOnlyScheduleConfig,
    Field(discriminator="name"),
]
"""Any schedule's configuration; pydantic picks the class from the ``name`` field."""


def stages_per_rank(config: PipelineScheduleConfig) -> int:
    """How many stages every rank holds under ``config``."""
    match config:
        case GPipeScheduleConfig() | OneFOneBScheduleConfig() | ForwardOnlyScheduleConfig():
            return 1
        case (
            Interleaved1F1BScheduleConfig()
            | LoopedBFSScheduleConfig()
            | InterleavedZeroBubbleScheduleConfig()
        ):
            return config.stages_per_rank
        case ZBVScheduleConfig() | DualPipeVScheduleConfig():
            return 2


def build_program(
    schedule: PipelineScheduleBuilder, *, num_ranks: int, num_microbatches: int
) -> PipelineProgram:
    """Builds the program ``schedule`` describes for ``num_ranks`` pipeline ranks.

    Raises:
        ValueError: If the schedule cannot use ``num_microbatches`` (the message names the schedule
            and the counts).
    """
    return schedule.build_program(num_ranks=num_ranks, num_microbatches=num_microbatches)


def stages_for_rank(config: PipelineScheduleConfig, *, num_ranks: int, rank: int) -> list[PipelineStageInfo]:
    """The stages ``rank`` must build under ``config``, in increasing stage order.

    Needs no microbatch count: the placement depends only on the schedule and the rank count.

    Raises:
        ValueError: If ``rank`` is not in ``[0, num_ranks)``.
    """
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank} is outside the {num_ranks} pipeline ranks")
    v = stages_per_rank(config)
    num_stages = v * num_ranks
    match config:
        case ZBVScheduleConfig() | DualPipeVScheduleConfig():
            stages = [rank, num_stages - 1 - rank]
        case _:
            stages = [c * num_ranks + rank for c in range(v)]
    return [PipelineStageInfo(s, num_stages) for s in sorted(stages)]
