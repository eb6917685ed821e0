"""Schedules under test, with the microbatch counts each can use."""

from __future__ import annotations

from d9d.pipeline import (
    DualPipeVScheduleConfig,
    GPipeScheduleConfig,
    Interleaved1F1BScheduleConfig,
    InterleavedZeroBubbleScheduleConfig,
    LoopedBFSScheduleConfig,
    OneFOneBScheduleConfig,
    PipelineScheduleConfig,
    ZBVScheduleConfig,
)

TRAINING_SCHEDULES: list[PipelineScheduleConfig] = [
    GPipeScheduleConfig(),
    OneFOneBScheduleConfig(),
    Interleaved1F1BScheduleConfig(stages_per_rank=2),
    LoopedBFSScheduleConfig(stages_per_rank=2),
    InterleavedZeroBubbleScheduleConfig(stages_per_rank=2),
    ZBVScheduleConfig(),
    DualPipeVScheduleConfig(),
    DualPipeVScheduleConfig(overlap=True),
]


def microbatch_counts(config: PipelineScheduleConfig, num_ranks: int) -> list[int]:
    """2 (or the smallest count the schedule accepts) and 8."""
    match config:
        case Interleaved1F1BScheduleConfig():
            smallest = num_ranks  # a multiple of the rank count
        case DualPipeVScheduleConfig():
            smallest = 2 * num_ranks
        case _:
            smallest = 2
    return sorted({max(2, smallest), 8})
