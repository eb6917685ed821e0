"""What both executors share: checks of stages against the program, forward-only views."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from d9d.pipeline._actions import ActionKind
from d9d.pipeline._communication import make_program
from d9d.pipeline._program import PipelineProgram


def check_stage_modules(program: PipelineProgram, rank: int, stages: Mapping[int, nn.Module]) -> None:
    """Raises if ``stages`` are not exactly the stages ``rank`` holds under ``program``."""
    expected = program.stages_of(rank)
    if sorted(stages) != expected:
        raise ValueError(
            f"rank {rank} holds stages {expected} of {program.num_stages} under this program, "
            f"but modules were given for stages {sorted(stages)}"
        )


def forward_only_view(program: PipelineProgram) -> PipelineProgram:
    """The program's forwards alone, in the same order per rank, with communication re-inserted."""
    if not program.training:
        return program
    return make_program(
        num_microbatches=program.num_microbatches,
        stage_to_rank=program.stage_to_rank,
        compute=[
            [a for a in program.compute_actions(r) if a.kind == ActionKind.FORWARD]
            for r in range(program.num_ranks)
        ],
        training=False,
    )
