"""Checks that a pipeline program can run on the stages the provider built."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule

from d9d.pipeline import ActionKind, PipelineProgram, PipelineStageInfo


def check_split_backward_fits(
    program: PipelineProgram | None, stages: Sequence[tuple[PipelineStageInfo, nn.Module]]
) -> None:
    """Refuses a split-backward (zero-bubble) program on FSDP-sharded stages, before any step.

    Such programs compute input gradients first and weight gradients later (``W`` actions).
    ``fully_shard`` reduces a module's gradients when gradients reach its inputs, which is the
    input pass here: the weight gradients would arrive after their reduction and be lost.

    Raises:
        ValueError: Naming the stage, when a program with ``W`` actions meets an FSDP module.
    """
    if program is None:
        return
    if not any(
        action.kind is ActionKind.BACKWARD_WEIGHT for actions in program.actions for action in actions
    ):
        return
    for info, model in stages:
        if any(isinstance(module, FSDPModule) for module in model.modules()):
            raise ValueError(
                f"trainer.pipeline: this schedule splits backward into input and weight gradients "
                f"(zero-bubble), but stage {info.current_stage} is sharded with FSDP (fully_shard; "
                f"model providers also apply it for a compute dtype such as param_dtype on one rank), "
                f"which reduces gradients before the weight gradients exist. Choose a schedule "
                f"without split backward (gpipe, 1f1b, interleaved_1f1b, looped_bfs), or build the "
                f"stages without FSDP"
            )
